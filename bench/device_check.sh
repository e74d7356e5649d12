#!/usr/bin/env bash
# The one prepared run for a lent machine with an NVIDIA GPU and many cores
# (the device tool): build in place with that machine's python3 (which holds
# torch, Cython, numpy and pytest-benchmark), train the demo on CUDA, and
# measure the allreduce step where the coordinator has cores for its socket
# threads. Everything it prints also lands in $OUT (./device-out if unset).
#
#   bash bench/device_check.sh                       # on the GPU machine
#   DEVICE=cpu DDPWIRE_BENCH_SIZES=1 bash bench/device_check.sh   # a dry run here
set -euo pipefail
OUT=${OUT:-device-out}
DEVICE=${DEVICE:-cuda}
export DDPWIRE_BENCH_SIZES=${DDPWIRE_BENCH_SIZES:-64}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

python3 setup.py build_ext --inplace -q 2>&1 | tail -5
{
    echo "cores: $(nproc)"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} | tee "$OUT/machine.txt"

# two workers on one device: every step's average must leave them identical
python3 -m ddpwire demo --workers 2 --device "$DEVICE" --steps 30 2>&1 | tee "$OUT/demo.txt"
grep -q "weights identical on all 2 workers" "$OUT/demo.txt"

python3 -m pytest -q -p no:cacheprovider bench/test_bench_allreduce.py \
    --benchmark-json="$OUT/allreduce.json" 2>&1 | tail -3
python3 bench/plot_allreduce.py "$OUT/allreduce.json" --png "$OUT/allreduce.png" \
    | tee "$OUT/allreduce.md"

# one CUDA rank and one CPU rank train one DDP model on backend "ddpwire"
OUT="$OUT" DEVICE="$DEVICE" bash bench/ddp_mixed_devices.sh

# a CUDA worker beside a CPU worker, shards by measured speed
OUT="$OUT" DEVICE="$DEVICE" bash bench/balance_mixed_devices.sh
