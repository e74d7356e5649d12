#!/usr/bin/env bash
# One DDP model trained by a CUDA rank and a CPU rank on backend "ddpwire"
# (tests/ddp_script.py, unmodified but for where rank 0's tensors live):
# both must end with identical weights. Called by bench/device_check.sh;
# DEVICE=cpu runs it as a dry run on any machine.
#
#   OUT=device-out DEVICE=cuda bash bench/ddp_mixed_devices.sh
set -euo pipefail
OUT=${OUT:-device-out}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT DDP_DEVICE=$DEVICE \
        DDP_DEVICE_RANKS=0 DDP_STEPS=20 timeout 300 \
        python3 tests/ddp_script.py "$OUT/mixed" ddpwire > "$OUT/mixed-rank$rank.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do
    wait "$pid" || { tail -n 30 "$OUT"/mixed-rank*.log; exit 1; }
done
python3 - "$OUT/mixed" "$DEVICE" <<'PY' | tee "$OUT/mixed.txt"
import sys
import torch
out, device = sys.argv[1], sys.argv[2]
ranks = [torch.load(f"{out}.ddpwire.rank{r}.pt", weights_only=False)["state"] for r in range(2)]
params = [k for k in ranks[0] if "running" not in k and "num_batches" not in k]
worst = max((ranks[0][k].double() - ranks[1][k].double()).abs().max().item() for k in params)
same = all(torch.equal(ranks[0][k], ranks[1][k]) for k in params)
print(f"rank 0 on {device}, rank 1 on cpu: {len(params)} parameters, "
      f"identical={same}, largest difference {worst:.3g}")
sys.exit(0 if same else 1)
PY
