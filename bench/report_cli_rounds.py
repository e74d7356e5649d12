"""Read bench/cli_rounds.sh's runs: each setting's throughput over the
round's ``--balance off`` run (the first ``*-off`` setting), their geometric
mean, and each run's median step, states and final shards; ``--json`` writes
it all (issue 38, stop 57).

    python bench/report_cli_rounds.py /tmp/cli-rounds --json bench/results/<name>.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(args.folder, "*.jsonl")):
        tag, r = os.path.basename(path)[:-len(".jsonl")].rsplit("-", 1)
        lines = [json.loads(x) for x in open(path)]
        steps = sorted(x["step_time_s"] for x in lines)
        runs[int(r)][tag] = {
            "throughput": sum(x["samples"] for x in lines) / sum(x["step_time_s"] for x in lines),
            "median_step_s": steps[len(steps) // 2],
            "states": dict(collections.Counter(x.get("balance") for x in lines)),
            "final_shards": [w["shard"] for w in lines[-1]["workers"]],
        }
    tags = sorted({t for r in runs.values() for t in r})
    base = next(t for t in tags if t.endswith("-off"))
    summary = {}
    for tag in tags:
        ratios = [runs[r][tag]["throughput"] / runs[r][base]["throughput"]
                  for r in sorted(runs) if tag in runs[r] and base in runs[r]]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        summary[tag] = {"over": base, "ratios": ratios, "geometric_mean": geo}
        print(f"{tag:24s} over {base}: {geo:.3f}  {[round(x, 3) for x in ratios]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rounds": {str(r): runs[r] for r in sorted(runs)}},
                      f, indent=1)


if __name__ == "__main__":
    main()
