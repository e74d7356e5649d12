"""Turn bench/test_bench_overlap.py's --benchmark-json output into the
markdown table of bench/results/notebook.md: step times and where the communication
went, flat against per-block, as ratios."""
import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    runs = {b["extra_info"]["mode"]: b for b in data["benchmarks"]}
    flat, block = runs["flat"], runs["per-block"]
    ms = lambda secs: f"{secs * 1e3:.1f}"  # noqa: E731
    print(f"gradient: {flat['extra_info']['gradient_mib']:.2f} MiB per worker per step\n")
    print("| mode | step median ms | step min ms | forward ms | backward ms | in send calls ms | exposed comm ms | hidden comm ms "
          "| hidden / (hidden + exposed) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, b in (("flat", flat), ("per-block", block)):
        info, stats = b["extra_info"], b["stats"]
        comm = info["hidden_comm_s"] + info["exposed_comm_s"]
        share = info["hidden_comm_s"] / comm if comm else 0.0
        print(f"| {name} | {ms(stats['median'])} | {ms(stats['min'])} | {ms(info['forward_s'])} "
              f"| {ms(info['backward_s'])} | {ms(info['send_s'])} | {ms(info['exposed_comm_s'])} | {ms(info['hidden_comm_s'])} "
              f"| {100 * share:.0f}% |")
    print()
    print(f"- step time, flat / per-block (median): **{flat['stats']['median'] / block['stats']['median']:.2f}x**")
    print(f"- step time, flat / per-block (min): {flat['stats']['min'] / block['stats']['min']:.2f}x")
    exposed = block["extra_info"]["exposed_comm_s"]
    if exposed:
        print(f"- exposed communication, flat / per-block: "
              f"**{flat['extra_info']['exposed_comm_s'] / exposed:.2f}x**")
    print(f"- per-block: first block sent {ms(block['extra_info']['first_send_lead_s'])} ms before backward ended; "
          f"median {block['extra_info']['averages_in_backward']:g} of the block averages back before it ended")


if __name__ == "__main__":
    main(sys.argv[1])
