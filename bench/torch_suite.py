"""PyTorch's own distributed tests on backend "gloo" or "ddpwire": the test
base ``DistributedTest._DistTestBase`` of the installed torch
(torch/testing/_internal/distributed/distributed_test.py), run the way
torch's test/distributed/test_distributed_spawn.py runs it: 3 ranks spawned
per test, a file:// store, BACKEND, WORLD_SIZE, TEMP_DIR and INIT_METHOD
set as torch's run_test.py sets them.

    python bench/torch_suite.py --backend gloo -j 2 --out bench/results/torch-suite-<commit>.json
    python bench/torch_suite.py --backend ddpwire -j 2 \\
        --tests-from bench/results/torch-suite-<commit>.json \\
        --out bench/results/torch-suite-<commit>.json

The first runs every test of the base on gloo; the second runs on ddpwire
the tests gloo ran and did not skip, and writes its side into the same file
(``--out`` keeps the other backends' entries already there). Without
``--out`` the file is bench/results/torch-suite-<commit>.json, and a new
file gets gloo's side from ``--tests-from``, so rerunning ddpwire at a
later commit is one command:

    python bench/torch_suite.py --backend ddpwire -j 2 \\
        --tests-from bench/results/torch-suite-<commit>.json

``-k TEXT`` keeps the tests whose name contains TEXT; ``--timeout`` is per
test; ``-j N`` runs N tests at a time (each with its own ranks and files).

Each test runs in its own process (and that process spawns the ranks), so a
test that hangs is killed with its ranks and recorded as "timeout". The
JSON: {"world_size", "torch", "backends": {BACKEND: {"commit", "elapsed_s",
"jobs", "counts", "tests": {NAME: {"outcome", "seconds", "message"}}}}},
outcome one of passed, failed, skipped, timeout; "message" holds a skip's reason or the
last lines of a failure. "commit" is ``git rev-parse --short HEAD``, with
"+" when the tree has changes, of this checkout or, for ddpwire, of the one
ddpwire is imported from: ``PYTHONPATH=OTHER_CHECKOUT`` (built in place)
tests another checkout's ddpwire with this script.

The base decides some skips by the backend's name: ``DistTestCases`` lists
which backends have a feature (ddp, subgroup, ...), and ddpwire is given
gloo's entries there and is a "plugin" (a backend registered by a package,
which the base counts as available). Tests that name gloo itself ("Only gloo
backend supports timeouts", ``require_backend_is_available({"gloo"})``)
stay skipped on ddpwire and are counted as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 3  # run_test.py's world size for gloo on a machine without 2 GPUs
#: set in the process that runs one test (and so in its spawned ranks)
CHILD_ENV = "DDPWIRE_TORCH_SUITE_CHILD"
#: for --as-gloo, the backend that runs in gloo's place (in the children too)
AS_GLOO_ENV = "DDPWIRE_TORCH_SUITE_AS_GLOO"
RESULT_MARK = "TORCH_SUITE_RESULT "
TAIL_LINES = 20


def groups_of(backend: str) -> None:
    """Make init_process_group and new_group build ``backend``'s groups
    where they are asked for gloo's, and check that they did."""
    import torch.distributed as dist

    def swap(name: object) -> object:
        return backend if name is not None and str(name) == "gloo" else name

    real_init, real_new = dist.init_process_group, dist.new_group

    def init_process_group(*args: object, **kwargs: object) -> None:
        if args:
            args = (swap(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        real_init(*args, **kwargs)
        if dist.get_backend() != backend:
            raise RuntimeError(f"the default group is {dist.get_backend()}'s, not {backend}'s")

    def new_group(*args: object, **kwargs: object) -> object:
        if len(args) > 2:
            args = (*args[:2], swap(args[2]), *args[3:])
        if "backend" in kwargs:
            kwargs["backend"] = swap(kwargs["backend"])
        return real_new(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


def load_case(backend: str, as_gloo: bool = False) -> type:
    """torch's TestDistBackendWithSpawn (test_distributed_spawn.py) on
    ``backend``; with ``as_gloo`` the base runs as for gloo (gloo's skips,
    gloo's branches in the tests' bodies) while every group it makes is
    ``backend``'s (:func:`groups_of`)."""
    os.environ["BACKEND"] = "gloo" if as_gloo else backend
    os.environ.setdefault("WORLD_SIZE", str(WORLD_SIZE))
    if backend == "ddpwire":
        import ddpwire.torch  # noqa: F401  (registers the backend)
    # the base's skip decorators read these sets when it is imported
    from torch.testing._internal.common_distributed import DistTestCases
    for table in (DistTestCases.backend_feature, DistTestCases.skip_collective):
        for backends in table.values():
            if "gloo" in backends:
                backends.add(backend)
    if backend != "gloo":  # a backend registered by a package, not built into torch
        DistTestCases.backend_feature["plugin"].add(backend)
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest, TestDistBackend)
    if as_gloo:
        groups_of(backend)

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    # the spawned ranks find the class by name in this module
    TestDistBackendWithSpawn.__qualname__ = TestDistBackendWithSpawn.__name__
    return TestDistBackendWithSpawn


if os.environ.get(CHILD_ENV):
    TestDistBackendWithSpawn = load_case(os.environ.get(AS_GLOO_ENV) or os.environ["BACKEND"],
                                         bool(os.environ.get(AS_GLOO_ENV)))


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_one(name: str) -> None:
    """In the child: run test ``name`` and print its outcome as a JSON line."""
    test = TestDistBackendWithSpawn(name)
    result = unittest.TestResult()
    test.run(result)
    if result.skipped:
        outcome, message = "skipped", result.skipped[0][1]
    elif result.failures or result.errors:
        outcome, message = "failed", tail((result.failures + result.errors)[0][1])
    else:
        outcome, message = "passed", ""
    print(RESULT_MARK + json.dumps({"outcome": outcome, "message": message}), flush=True)


def child_env(backend: str, temp_dir: str) -> Dict[str, str]:
    """The environment run_test.py gives test_distributed_spawn.py."""
    for sub in ("barrier", "test_dir"):
        os.makedirs(os.path.join(temp_dir, sub), exist_ok=True)
    return dict(os.environ, BACKEND=backend, WORLD_SIZE=str(WORLD_SIZE), TEMP_DIR=temp_dir,
                INIT_METHOD="env://", PYTORCH_PRINT_REPRO_ON_FAILURE="0", **{CHILD_ENV: "1"})


def run_in_child(backend: str, name: str, timeout: float) -> Dict[str, object]:
    """Run one test in a new process group; kill the group past ``timeout``."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp_dir:
        proc = subprocess.Popen([sys.executable, __file__, "--one", name],
                                env=child_env(backend, temp_dir), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return {"outcome": "timeout", "seconds": round(time.monotonic() - start, 1),
                    "message": f"killed after {timeout:g} s\n" + tail(out)}
    seconds = round(time.monotonic() - start, 1)
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            return dict(json.loads(line[len(RESULT_MARK):]), seconds=seconds)
    return {"outcome": "failed", "seconds": seconds,
            "message": f"exit {proc.returncode}, no result\n" + tail(out)}


def static_skip(case: type, name: str) -> Optional[str]:
    """The reason of a skip decided when the base was imported, else None."""
    method = getattr(case, name)
    if getattr(case, "__unittest_skip__", False) or getattr(method, "__unittest_skip__", False):
        return getattr(method, "__unittest_skip_why__", "") or case.__unittest_skip_why__
    return None


def run_test(backend: str, case: type, name: str, timeout: float) -> Dict[str, object]:
    """One test's result: a skip decided at import, else the test run in a child."""
    reason = static_skip(case, name)
    if reason is not None:
        return {"outcome": "skipped", "seconds": 0.0, "message": reason}
    return run_in_child(backend, name, timeout)


def selected_tests(case: type, tests_from: Optional[str], keyword: Optional[str]) -> List[str]:
    """The base's tests, or those gloo ran without skipping in ``tests_from``."""
    if tests_from:
        gloo = json.loads(Path(tests_from).read_text())["backends"]["gloo"]["tests"]
        names = [n for n, r in gloo.items() if r["outcome"] != "skipped"]
    else:
        names = unittest.TestLoader().getTestCaseNames(case)
    return sorted(n for n in names if not keyword or keyword in n)


def counts(tests: Dict[str, Dict[str, object]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for result in tests.values():
        out[str(result["outcome"])] = out.get(str(result["outcome"]), 0) + 1
    return out


def checkout(backend: str) -> Path:
    """The checkout under test: the one ddpwire is imported from, for ddpwire."""
    if backend == "ddpwire":
        import ddpwire
        return Path(ddpwire.__file__).resolve().parent.parent
    return ROOT


def run_suite(backend: str, case: type, names: List[str], timeout: float,
              jobs: int) -> Dict[str, object]:
    """Run ``names``, ``jobs`` tests at a time."""
    from allreduce_procs import baseline_commit
    start = time.monotonic()
    tests: Dict[str, Dict[str, object]] = {}
    with ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_test, backend, case, n, timeout): n for n in names}
        for i, future in enumerate(as_completed(futures), 1):
            name = futures[future]
            tests[name] = future.result()
            print(f"[{i}/{len(names)}] {backend} {name}: {tests[name]['outcome']} "
                  f"({tests[name]['seconds']} s)", flush=True)
    return {"commit": baseline_commit(str(checkout(backend))),
            "elapsed_s": round(time.monotonic() - start, 1), "jobs": jobs,
            "counts": counts(tests), "tests": dict(sorted(tests.items()))}


def write(out: Path, backend: str, run: Dict[str, object], tests_from: Optional[str]) -> None:
    """Put ``run`` under ``backend`` in ``out``, keeping the other backends
    there; a new file gets gloo's run from ``tests_from``, the list's source."""
    import torch
    doc = json.loads(out.read_text()) if out.exists() else {}
    runs = doc.setdefault("backends", {})
    if tests_from and "gloo" not in runs:
        runs["gloo"] = json.loads(Path(tests_from).read_text())["backends"]["gloo"]
    runs[backend] = run
    doc.update(world_size=WORLD_SIZE, torch=torch.__version__)
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "ddpwire"), default="gloo")
    p.add_argument("--tests-from", metavar="JSON",
                   help="run the tests gloo ran (not skipped) in this earlier result file")
    p.add_argument("-k", dest="keyword", help="only tests whose name contains this")
    p.add_argument("--as-gloo", action="store_true",
                   help="run the base as for gloo (its skips and branches) with --backend's "
                        "groups in gloo's place (kept in the result file as '<backend> as gloo')")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("-j", "--jobs", type=int, default=1, help="tests run at the same time")
    p.add_argument("--out", type=Path, help="result file (default torch-suite-<commit>.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # in the child: the test to run
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.one:
        run_one(args.one)
        return
    if args.as_gloo:
        os.environ[AS_GLOO_ENV] = args.backend  # the children import the base as this process does
    case = load_case(args.backend, args.as_gloo)
    names = selected_tests(case, args.tests_from, args.keyword)
    run = run_suite(args.backend, case, names, args.timeout, args.jobs)
    out = args.out or ROOT / "bench" / "results" / f"torch-suite-{run['commit']}.json"
    key = f"{args.backend} as gloo" if args.as_gloo else args.backend
    write(out, key, run, args.tests_from)
    print(f"{key}: {run['counts']} in {run['elapsed_s']} s -> {out}")


if __name__ == "__main__":
    main()
