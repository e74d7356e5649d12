"""Benchmark process groups whose members run in the cluster's namespaces.

The same kinds and step protocol as bench/allreduce_procs.py's
ProcessGroup, whose step/stop/kill this reuses; only the start differs: each
member is a subprocess under ``ip netns exec``, and addresses are the
plan's instead of 127.0.0.1.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from typing import Any, Optional, Tuple

import allreduce_procs as procs
from ddp_step import DDP_KINDS

from . import net
from .plan import MACHINE_IF, Plan

_NODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# rank 0's store; a fresh port per group so a previous group's TIME_WAIT cannot refuse it
GLOO_BASE_PORT = 29500
_ctx = mp.get_context("spawn")
_gloo_groups = 0


def _baseline(kind: str) -> str:
    """The older checkout a baseline kind imports ddpwire from."""
    path = os.environ.get(procs.BASELINE_ENV)
    if not path:
        raise ValueError(f"kind {kind} needs ${procs.BASELINE_ENV}: a built checkout of "
                         f"the commit to compare with")
    return path


class NodeProcess:
    """A subprocess in a namespace, with the few mp.Process methods ProcessGroup uses."""

    def __init__(self, netns: str, name: str, target: str, args: tuple) -> None:
        self.name = name
        parent, child = _ctx.Pipe()
        env = dict(os.environ)
        # the checkout's ddpwire, whatever the namespace's working directory
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, env.get("PYTHONPATH")]))
        env["GLOO_SOCKET_IFNAME"] = MACHINE_IF
        # the namespaces emulate separate machines, but share this host's
        # /dev/shm and boot id: shared memory would bypass the links measured
        env["DDPWIRE_SHM"] = "0"
        # and a hostname of its own, as a separate machine has: nothing may
        # take two nodes for one host
        self.popen = subprocess.Popen(
            net.exec_prefix(netns) + ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                                      netns, sys.executable, _NODE, str(child.fileno())],
            pass_fds=[child.fileno()], env=env, cwd=_REPO)
        child.close()
        self.conn = parent
        parent.send((target, args))

    def is_alive(self) -> bool:
        """Whether the process has not exited yet."""
        return self.popen.poll() is None

    def terminate(self) -> None:
        """SIGTERM (``ip netns exec`` execs python, so this is python's pid)."""
        if self.is_alive():
            self.popen.terminate()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait up to ``timeout``; then kill, so a wedged child never outlives the run."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


class ClusterGroup(procs.ProcessGroup):
    """``procs.ProcessGroup`` with the coordinator in the plan's coordinator
    namespace and worker/rank k in worker k's; "tcp" sends from worker 0 to
    the coordinator's machine."""

    def __init__(self, kind: str, n: int, size: int, steps: int, plan: Plan) -> None:
        if n > len(plan.workers):
            raise ValueError(f"{n} workers asked, the cluster has {len(plan.workers)}")
        self.plan = plan
        super().__init__(kind, n, size, steps)

    def _launch(self, netns: str, target: str, args: tuple, name: str) -> Tuple[Any, NodeProcess]:
        proc = NodeProcess(netns, name, target, args)
        return proc.conn, proc

    def _add_in(self, netns: str, target: str, args: tuple, name: str) -> None:
        conn, proc = self._launch(netns, target, args, name)
        self.conns.append(conn)
        self.procs.append(proc)

    def _start(self) -> None:
        global _gloo_groups
        p, n, size = self.plan, self.n, self.size
        if self.kind in procs.DDPWIRE_KINDS:
            baseline = None
            if procs.ddpwire_kind(self.kind).baseline:
                baseline = _baseline(self.kind)
            procs.start_ddpwire(
                self,
                lambda args: self._launch(p.coordinator.netns, "_ddpwire_coordinator", args,
                                          "ddpwire-coordinator"),
                lambda rank, args: self._add_in(p.workers[rank].netns, "_ddpwire_worker", args,
                                                f"ddpwire-worker-{rank}"),
                baseline, host=p.coordinator.address)
        elif self.kind == "gloo":
            port = GLOO_BASE_PORT + _gloo_groups
            _gloo_groups += 1
            for rank in range(n):
                self._add_in(p.workers[rank].netns, "_gloo_worker",
                             (port, rank, n, size, p.workers[0].address), f"gloo-rank-{rank}")
        elif self.kind in DDP_KINDS:
            # a DDP script on each rank's machine, rank 0's store on worker 0
            port = GLOO_BASE_PORT + _gloo_groups
            _gloo_groups += 1
            baseline = _baseline(self.kind) if DDP_KINDS[self.kind][2] else None
            for rank in range(n):
                self._add_in(p.workers[rank].netns, "_ddp_rank",
                             (self.kind, port, rank, n, p.workers[0].address, baseline),
                             f"ddp-rank-{rank}")
        elif self.kind == "tcp":
            self._add_in(p.coordinator.netns, "_tcp_receiver", (size, p.coordinator.address),
                         "tcp-receiver")
            addr = procs._reply(self.conns[0], self.procs[0], "addr")
            self._add_in(p.workers[0].netns, "_tcp_sender", (addr, size), "tcp-sender")
        else:
            raise ValueError(f"unknown kind {self.kind!r}")
        for conn, proc in zip(self.conns, self.procs):
            procs._reply(conn, proc, "ready")
