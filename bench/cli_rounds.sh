#!/usr/bin/env bash
# Rounds of `ddpwire coordinator` + N `ddpwire worker` runs on loopback, one
# run per setting a round, the order turned by one each round (issue 38,
# stop 57): settings are CHECKOUT:BALANCE (a built checkout, and its
# --balance), so two commits, or a commit and a patched worktree, run side
# by side. Each run's --metrics lands in $OUT as <checkout name>-<balance>-<round>.jsonl;
# bench/report_cli_rounds.py reads them.
#
#   N=5 SAMPLES=64 WORKERS=2 OUT=/tmp/rounds bench/cli_rounds.sh /work/a:auto /work/a:off /work/b:auto
set -euo pipefail
N=${N:-5}; SAMPLES=${SAMPLES:-64}; WORKERS=${WORKERS:-2}; MODEL=${MODEL:-mlp}
STEPS=${STEPS:-3000}; OUT=${OUT:-/tmp/cli-rounds}; PY=${PY:-python}
mkdir -p "$OUT"
SETTINGS=("$@")
one() {  # checkout balance metrics
    local port=$((20000 + RANDOM % 20000)) pids=()
    # every process starts in the checkout: `python -m` puts the working
    # directory ahead of PYTHONPATH
    (cd "$1" && PYTHONPATH="$1" exec "$PY" -m ddpwire coordinator --bind 127.0.0.1:$port \
        --workers "$WORKERS" --steps "$STEPS" --samples "$SAMPLES" --balance "$2" \
        --metrics "$3" --join-timeout 60 > "$3.out" 2>&1) & pids+=($!)
    for _ in $(seq "$WORKERS"); do
        (cd "$1" && PYTHONPATH="$1" exec "$PY" -m ddpwire worker --connect 127.0.0.1:$port \
            --samples "$SAMPLES" --model "$MODEL" --log-level WARNING --timeout 60 > /dev/null 2>&1) &
        pids+=($!)
    done
    wait "${pids[@]}"
}
for r in $(seq 0 $((N - 1))); do
    for k in $(seq 0 $((${#SETTINGS[@]} - 1))); do
        IFS=: read -r root balance <<< "${SETTINGS[$(((k + r) % ${#SETTINGS[@]}))]}"
        one "$root" "$balance" "$OUT/$(basename "$root")-$balance-$r.jsonl"
    done
done
