"""Turn bench/test_bench_reduce.py's (the mean) or bench/test_bench_total.py's
(the sum) --benchmark-json output into the markdown table of
bench/results/notebook.md: median times, ratios, GB/s."""
import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows = defaultdict(dict)
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        rows[(info["mib"], info["k"])][info["impl"]] = (bench["stats"]["median"], info["bytes_moved"])
    if any(b["extra_info"].get("op") == "total" for b in data["benchmarks"]):
        total_table(rows)
        return
    print("| size | k | ddpwire ms | 1 thread ms | numpy ms | memcpy ms | vs numpy | 1 thread vs numpy "
          "| ddpwire GB/s | 1 thread GB/s | memcpy GB/s | % of memcpy | 1 thread % of memcpy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mib, k), impls in sorted(rows.items()):
        t = {name: v[0] for name, v in impls.items()}
        moved = impls["ddpwire"][1]
        gbs = {name: moved / secs / 1e9 for name, secs in t.items()}
        print(
            f"| {mib} MiB | {k} | {t['ddpwire'] * 1e3:.2f} | {t['ddpwire-1thread'] * 1e3:.2f} "
            f"| {t['numpy'] * 1e3:.2f} | {t['memcpy'] * 1e3:.2f} "
            f"| {t['numpy'] / t['ddpwire']:.2f}x | {t['numpy'] / t['ddpwire-1thread']:.2f}x "
            f"| {gbs['ddpwire']:.1f} | {gbs['ddpwire-1thread']:.1f} | {gbs['memcpy']:.1f} "
            f"| {100 * t['memcpy'] / t['ddpwire']:.0f}% | {100 * t['memcpy'] / t['ddpwire-1thread']:.0f}% |"
        )


def total_table(rows) -> None:
    print("| size | k | total ms | k passes ms | numpy ms | k passes / total | numpy / total "
          "| total GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (mib, k), impls in sorted(rows.items()):
        t = {name: v[0] for name, v in impls.items()}
        print(f"| {mib} MiB | {k} | {t['ddpwire'] * 1e3:.2f} | {t['ddpwire-passes'] * 1e3:.2f} "
              f"| {t['numpy'] * 1e3:.2f} | {t['ddpwire-passes'] / t['ddpwire']:.2f}x "
              f"| {t['numpy'] / t['ddpwire']:.2f}x "
              f"| {impls['ddpwire'][1] / t['ddpwire'] / 1e9:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
