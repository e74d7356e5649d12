#!/usr/bin/env bash
# A CUDA worker beside a CPU worker, shards by measured speed: a standalone
# coordinator with --balance on and --metrics, and two `ddpwire worker`
# processes, the first on $DEVICE, the second on the CPU. Prints each
# step's split (the faster device should take most of each step) and checks
# both workers end with identical weights. Called by bench/device_check.sh;
# DEVICE=cpu runs it as a dry run on any machine.
#
#   OUT=device-out DEVICE=cuda bash bench/balance_mixed_devices.sh
set -euo pipefail
OUT=${OUT:-device-out}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-40}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
timeout 600 python3 -m ddpwire coordinator --bind "127.0.0.1:$PORT" --workers 2 --steps "$STEPS" \
    --samples 512 --balance on --metrics "$OUT/balance-metrics.jsonl" --timeout 120 \
    > "$OUT/balance-coordinator.log" 2>&1 &
coord=$!
w=()
for device in "$DEVICE" cpu; do
    # the CPU worker gets one thread: a small machine beside the fast one
    OMP_NUM_THREADS=1 timeout 600 python3 -m ddpwire worker --connect "127.0.0.1:$PORT" \
        --samples 512 --device "$device" --threads 1 --timeout 120 \
        --report "$OUT/balance-$device-${#w[@]}.json" > "$OUT/balance-worker${#w[@]}.log" 2>&1 &
    w+=($!)
done
for pid in "${w[@]}" "$coord"; do
    wait "$pid" || { tail -n 30 "$OUT"/balance-*.log; exit 1; }
done
python3 - "$OUT" "$DEVICE" <<'PY' | tee "$OUT/balance.txt"
import glob, json, sys
out, device = sys.argv[1], sys.argv[2]
reports = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/balance-*-[01].json"))]
lines = [json.loads(x) for x in open(f"{out}/balance-metrics.jsonl")]
for line in lines[:3] + lines[-3:]:
    print(f"step {line['step']:>3}: shards", [w["shard"] for w in line["workers"]],
          " compute ms", [round(1000 * (w["compute_s"] or 0), 1) for w in line["workers"]],
          " waited for worker", line["waited_for"])
same = len({r["weights_sha256"] for r in reports}) == 1
print(f"worker 0 on {device}, worker 1 on cpu: weights identical: {same}")
sys.exit(0 if same and len(reports) == 2 else 1)
PY
