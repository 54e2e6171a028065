#!/bin/bash
# The overload experiment of benchmarks/overload.sh in the simulator: the same workload, rates,
# SLO and the three admission settings, on the engine's scheduler with an overlap cost model
# (DECODE_MS per decode step, PREFILL_TPS prefill tokens/s), or with PROFILE=P.json the linear
# cost model `sloserve profile --from-trace` fitted to a step trace of the real server.
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"2 4 6 8"}; N=${N:-60}; IN=${IN:-256}; OUTLEN=${OUTLEN:-32}
SLO=${SLO:-"ttft:1000 tpot:300"}; DECODE_MS=${DECODE_MS:-20}; PREFILL_TPS=${PREFILL_TPS:-2200}
if [ -n "${PROFILE:-}" ]; then COST="--profile $PROFILE"
else COST="--decode-step-ms $DECODE_MS --prefill-tokens-per-s $PREFILL_TPS"; fi
TTFT_MS=${SLO#ttft:}; TTFT_MS=${TTFT_MS%% *}
echo "| rate (req/s) | fcfs goodput | queue-limit goodput | slo-aware goodput |"
echo "|---|---:|---:|---:|"
for r in $RATES; do
  row="| $r"
  for args in "" "--max-waiting-requests 4" "--ttft-slo-ms $TTFT_MS"; do
    g=$(.venv/bin/sloserve sim --dataset-name random --random-input-len "$IN" --random-output-len "$OUTLEN" \
        --num-prompts "$N" --request-rate "$r" --seed 7 $COST --goodput $SLO $args 2>&1 | awk -F: '/Request goodput/ {gsub(/ /,"",$2); print $2}')
    row="$row | $g"
  done
  echo "$row |"
done
