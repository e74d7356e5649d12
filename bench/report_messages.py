"""bench/test_bench_messages.py's --benchmark-json as a markdown table: each
message's round trip (encode_frame + decode_frame) in this tree and the
baseline checkout, medians, and this tree's time over the baseline's."""
import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows = defaultdict(dict)
    baseline = "?"
    for bench in data["benchmarks"]:
        p = bench["params"]
        batch = bench["extra_info"]["batch"]
        rows[p["name"]][p["side"]] = bench["stats"]["median"] / batch
        baseline = bench["extra_info"].get("baseline", baseline)
    commit = data.get("commit_info", {}).get("id", "?")[:7]
    print(f"| message | {commit} µs | {baseline} µs | {commit} / {baseline} |")
    print("|:---|---:|---:|---:|")
    for name, sides in rows.items():
        this, base = sides.get("this"), sides.get("baseline")
        ratio = f"{this / base:.2f}x" if this and base else "-"
        print(f"| {name} | {this * 1e6:.2f} | {base * 1e6 if base else float('nan'):.2f} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
