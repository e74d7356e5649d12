"""What torch's backend autoload (ddpwire's ``torch.backends`` entry point)
adds to ``import torch``.

Times ``python -c "import torch"`` in fresh interpreters, alternating
TORCH_DEVICE_BACKEND_AUTOLOAD=0 and =1 in the same run so that drift in the
machine's load hits both the same way: wall time, and the child's CPU time
(user + system), which other processes' load disturbs less. Prints the median
of each, the difference and the ratio.

A difference of medians over whole imports of a second or more is noisy. So
it also times, in fresh interpreters that imported torch with autoload off,
exactly what autoload adds: torch's ``_import_device_backends()`` (the entry
point scan plus every hook), and ddpwire's hook alone (loading the entry point
and calling it).

Writes the raw times to bench/results/import-cost-<commit>.json; the commit is
``git rev-parse --short HEAD``, with a "+" when the work tree has changes.

    python bench/import_cost.py [-n 15]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ("import sys, torch, torch.distributed as d; "
         "print('_ddpwire_autoload' in sys.modules, 'ddpwire' in d.Backend.backend_list, "
         "any(m == 'ddpwire' or m.startswith('ddpwire.') for m in sys.modules))")


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain") else "")


def env(autoload: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e["TORCH_DEVICE_BACKEND_AUTOLOAD"] = autoload
    return e


def once(autoload: str) -> tuple:
    """Wall and CPU milliseconds for one fresh interpreter to import torch and exit."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", "import torch"], env=env(autoload), cwd="/")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = (time.perf_counter() - start) * 1e3
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"import torch failed with TORCH_DEVICE_BACKEND_AUTOLOAD={autoload}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1e3


HOOK = """
import sys, time
import torch
from importlib.metadata import entry_points
ep, = [e for e in entry_points(group="torch.backends") if e.name == "ddpwire"]
start = time.perf_counter()
ep.load()()
alone = time.perf_counter() - start
# forget both, so that torch's autoload imports and registers again from scratch
torch.distributed.Backend._plugins.pop("DDPWIRE")
del sys.modules["_ddpwire_autoload"]
start = time.perf_counter()
torch._import_device_backends()
print(alone * 1e3, (time.perf_counter() - start) * 1e3)
"""


def hook_ms() -> tuple:
    """(ddpwire's hook alone: importing and calling it, torch's whole
    autoload: the entry point scan and every hook) in ms, in one fresh
    interpreter that imported torch with autoload off."""
    out = subprocess.run([sys.executable, "-c", HOOK], env=env("0"), cwd="/",
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="runs of each setting (default 15)")
    args = parser.parse_args()

    # the hook must really run with =1 (and not with =0), or the figures mean nothing
    seen = {}
    for autoload in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", CHECK], env=env(autoload), cwd="/",
                             capture_output=True, text=True, check=True).stdout.split()
        seen[autoload] = dict(zip(("hook_loaded", "registered", "ddpwire_imported"),
                                  (w == "True" for w in out)))
    if not seen["1"]["hook_loaded"] or seen["0"]["hook_loaded"]:
        sys.exit(f"the ddpwire hook does not follow TORCH_DEVICE_BACKEND_AUTOLOAD: {seen} "
                 "(is ddpwire installed with its entry point? pip install -e .)")

    once("1"), once("0")  # warm the page cache, not counted
    wall = {"0": [], "1": []}
    cpu = {"0": [], "1": []}
    for i in range(args.n):
        order = ("0", "1") if i % 2 == 0 else ("1", "0")
        for autoload in order:
            w, c = once(autoload)
            wall[autoload].append(w)
            cpu[autoload].append(c)
    hooks = [hook_ms() for _ in range(args.n)]
    alone = [h[0] for h in hooks]
    whole = [h[1] for h in hooks]

    med = statistics.median
    off, on = med(wall["0"]), med(wall["1"])
    coff, con = med(cpu["0"]), med(cpu["1"])
    import torch

    result = {
        "commit": commit(),
        "n": args.n,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_backends_entry_points": sorted(f"{ep.name} = {ep.value}"
                                              for ep in entry_points(group="torch.backends")),
        "check": seen,
        "wall_ms": {"autoload_0": wall["0"], "autoload_1": wall["1"]},
        "cpu_ms": {"autoload_0": cpu["0"], "autoload_1": cpu["1"]},
        "median_wall_ms": {"autoload_0": off, "autoload_1": on},
        "median_cpu_ms": {"autoload_0": coff, "autoload_1": con},
        "added_wall_ms": on - off,
        "added_cpu_ms": con - coff,
        "ratio_wall": on / off,
        "ratio_cpu": con / coff,
        "ddpwire_hook_ms": alone,
        "torch_autoload_ms": whole,
        "median_ddpwire_hook_ms": med(alone),
        "median_torch_autoload_ms": med(whole),
    }
    out = ROOT / "bench" / "results" / f"import-cost-{result['commit']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"import torch, median of {args.n} fresh interpreters each:")
    print(f"  wall: autoload off {off:.0f} ms, on {on:.0f} ms, added {on - off:+.1f} ms, "
          f"ratio {on / off:.3f}")
    print(f"  cpu:  autoload off {coff:.0f} ms, on {con:.0f} ms, added {con - coff:+.1f} ms, "
          f"ratio {con / coff:.3f}")
    print(f"  in process: torch's autoload {med(whole):.2f} ms (entry point scan and every hook), "
          f"ddpwire's hook alone {med(alone):.2f} ms ({100 * med(alone) / coff:.2f}% of the "
          f"import's cpu time)")
    print(f"entry points in torch.backends: {result['torch_backends_entry_points']}")
    print(f"raw times: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
