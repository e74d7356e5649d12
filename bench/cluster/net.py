"""Creating and removing the emulated cluster's namespaces, links and qdiscs.

Needs root and iproute2 (``ip``, ``tc``). Removal deletes whole namespaces:
a veth pair dies with either of its namespaces, so nothing else is left.
Processes still inside a namespace would keep it (and its links) alive
after ``ip netns del``, so they are killed first, by pid.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import List, Optional

from . import plan as _plan
from . import shaping

# one ip/tc call is milliseconds; more than this means the system is wedged
CMD_TIMEOUT = 20.0


class NetworkUnavailable(RuntimeError):
    """The emulated cluster cannot be built here (not root, no iproute2, no netns)."""


def _run(args: List[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=CMD_TIMEOUT,
                          check=check)


def why_unavailable() -> Optional[str]:
    """A reason the cluster cannot be built on this machine, or None if it can be tried."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's {tool!r} on PATH"
    return None


def namespaces() -> List[str]:
    """Names of every named network namespace on the host."""
    out = _run(["ip", "netns", "list"]).stdout
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(netns: str) -> None:
    pids = _run(["ip", "netns", "pids", netns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespaces(names: List[str]) -> None:
    """Kill what runs inside each namespace, then delete it; missing ones are fine."""
    for name in names:
        _kill_inside(name)
    for name in names:
        _run(["ip", "netns", "del", name], check=False)


def remove_leftovers(prefix: str = _plan.PREFIX) -> List[str]:
    """Delete the namespaces a crashed run with ``prefix`` left behind; returns their names."""
    stale = [ns for ns in namespaces() if _plan.is_ours(ns, prefix)]
    # machines first, the bridge last, as a normal teardown does
    stale.sort(key=lambda ns: ns.endswith("-br"))
    delete_namespaces(stale)
    return stale


def setup_commands(p: _plan.Plan) -> List[List[str]]:
    """Every ip/tc call that builds ``p``, in order (pure, so it can be tested)."""
    br = p.bridge_netns
    cmds = [["ip", "netns", "add", ns] for ns in [br] + [m.netns for m in p.machines]]
    cmds += [["ip", "-n", br, "link", "add", _plan.BRIDGE, "type", "bridge"],
             ["ip", "-n", br, "link", "set", _plan.BRIDGE, "up"],
             ["ip", "-n", br, "link", "set", "lo", "up"]]
    for m in p.machines:
        cmds += [
            # created inside the bridge namespace with its peer moved straight to the
            # machine's: the root namespace never holds either end
            ["ip", "-n", br, "link", "add", m.port, "type", "veth",
             "peer", "name", _plan.MACHINE_IF, "netns", m.netns],
            ["ip", "-n", br, "link", "set", m.port, "master", _plan.BRIDGE],
            ["ip", "-n", br, "link", "set", m.port, "up"],
            ["ip", "-n", m.netns, "addr", "add", f"{m.address}/{p.prefixlen}",
             "dev", _plan.MACHINE_IF],
            ["ip", "-n", m.netns, "link", "set", _plan.MACHINE_IF, "up"],
            ["ip", "-n", m.netns, "link", "set", "lo", "up"],
            # what the machine sends, then what it receives
            shaping.tbf_command(m.netns, _plan.MACHINE_IF, m.rate),
            shaping.tbf_command(br, m.port, m.rate),
        ]
        if p.congestion is not None:
            # a sysctl per namespace: what every socket on that machine starts with
            cmds.append(["ip", "netns", "exec", m.netns, "sysctl", "-q", "-w",
                         f"net.ipv4.tcp_congestion_control={p.congestion}"])
    return cmds


def _hint(cmd: List[str]) -> str:
    # a namespace may only choose what the host allows; the host's own
    # default is always allowed, others must be listed
    if any(a.startswith("net.ipv4.tcp_congestion_control=") for a in cmd):
        name = cmd[-1].split("=", 1)[1]
        return (f" (a namespace may only choose an algorithm the host lists in "
                f"net.ipv4.tcp_allowed_congestion_control: add {name} there)")
    return ""


def congestion_in(netns: str) -> str:
    """The TCP congestion control sockets inside ``netns`` start with."""
    return _run(exec_prefix(netns) + ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]
                ).stdout.strip()


class Cluster:
    """The emulated network of ``plan`` for the duration of a ``with`` block.

    Entering removes leftovers of a crashed run, then builds the network;
    leaving (normally, by an exception, or on SIGINT/SIGTERM while inside)
    deletes it. ``close()`` may be called more than once.
    """

    def __init__(self, p: _plan.Plan) -> None:
        self.plan = p
        self._open = False
        self._previous: dict = {}

    def __enter__(self) -> "Cluster":
        reason = why_unavailable()
        if reason:
            raise NetworkUnavailable(reason)
        self._install_handlers()
        try:
            remove_leftovers(self.plan.prefix)
            self._open = True
            for cmd in setup_commands(self.plan):
                res = _run(cmd, check=False)
                if res.returncode != 0:
                    raise NetworkUnavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()}"
                                             f"{_hint(cmd)}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace of the plan and restore the signal handlers."""
        if self._open:
            self._open = False
            delete_namespaces(self.plan.namespaces)
        self._restore_handlers()

    def _install_handlers(self) -> None:
        def on_signal(signum: int, frame) -> None:
            # tear down first: the exception below may be swallowed by whoever catches it
            self.close()
            # SIGTERM too: pytest ends the session on KeyboardInterrupt, while a
            # SystemExit inside a test only fails that test and runs the next
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, on_signal)
            except ValueError:
                # not the main thread: rely on the finally blocks alone
                pass

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except ValueError:
                pass
        self._previous.clear()


def exec_prefix(netns: str) -> List[str]:
    """The argv prefix that runs a command inside ``netns``."""
    return ["ip", "netns", "exec", netns]


if __name__ == "__main__":
    # `python -m cluster.net` from bench/: remove what a killed run left behind
    import sys
    reason = why_unavailable()
    if reason:
        sys.exit(reason)
    print("removed:", " ".join(remove_leftovers()) or "nothing")
