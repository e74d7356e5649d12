"""Test-session setup that every test file shares.

Children start with SIGINT's default disposition whatever this process
inherited: a suite run as a background job of a non-interactive shell (or by
a service manager) starts with SIGINT ignored, and an ignored signal stays
ignored across fork and exec, so the tests that interrupt a child as Ctrl-C
would (the demo, the coordinator, a rank) would wait out its timeouts. A
handled signal is reset to its default at exec, so handling it here is
enough; this process is interruptible as a terminal's would be.
"""
from __future__ import annotations

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
