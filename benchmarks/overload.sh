#!/bin/bash
# Overload: goodput of one sloserve server under a Poisson rate ramp past its capacity, for three
# admission settings (FCFS unbounded, a queue limit, SLO-aware admission), then the same runs in
# the simulator with the engine's profiled costs. Results: $OUT/<config>/rate<R>.json, summary
# printed as a table (goodput = requests meeting TTFT and TPOT limits per second).
#
#   bash benchmarks/overload.sh   # OUT=/tmp/overload RATES="2 4 8 12 16 24" N=60 NAMES="fcfs queue-limit slo-aware"
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/overload}; RATES=${RATES:-"2 4 8 12 16 24"}; N=${N:-60}
IN=${IN:-256}; OUTLEN=${OUTLEN:-32}; SLO=${SLO:-"ttft:1000 tpot:300"}
TTFT_MS=${SLO#ttft:}; TTFT_MS=${TTFT_MS%% *}
PORT=${PORT:-8291}
declare -A CONFIGS=(
  [fcfs]=""
  [queue-limit]="--max-waiting-requests 4"
  [slo-aware]="--ttft-slo-ms $TTFT_MS"
)
mkdir -p "$OUT"
for name in ${NAMES:-fcfs queue-limit slo-aware}; do
  mkdir -p "$OUT/$name"
  .venv/bin/sloserve serve --port "$PORT" --log-level warning ${CONFIGS[$name]} >"$OUT/$name/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
  for r in $RATES; do
    # every rate sends the same prompts (seed 7): forget the last rate's cached blocks, or later
    # rates would be served from the prefix cache and look faster than they are
    curl -sf -X POST "localhost:$PORT/reset_prefix_cache" >/dev/null
    .venv/bin/sloserve bench --port "$PORT" --dataset-name random --random-input-len "$IN" \
      --random-output-len "$OUTLEN" --num-prompts "$N" --request-rate "$r" --ignore-eos \
      --seed 7 --goodput $SLO --save-result --result-dir "$OUT/$name" \
      --result-filename "rate$r.json" >"$OUT/$name/bench-rate$r.txt" 2>&1 || true
  done
  kill -INT $pid; wait $pid || true
done
.venv/bin/python - "$OUT" $RATES <<'PY'
import json, sys, os
out, rates = sys.argv[1], sys.argv[2:]
print("| rate (req/s) | " + " | ".join(f"{n}: goodput / done / refused / P99 TTFT ms" for n in ("fcfs", "queue-limit", "slo-aware")) + " |")
print("|---|" + "---|" * 3)
for r in rates:
    row = [r]
    for n in ("fcfs", "queue-limit", "slo-aware"):
        try:
            d = json.load(open(os.path.join(out, n, f"rate{r}.json")))
        except OSError:
            row.append("-"); continue
        row.append(f"{d.get('request_goodput', 0):.2f} / {d['completed']} / {d['failed']} / {d.get('p99_ttft_ms', 0):,.0f}")
    print("| " + " | ".join(row) + " |")
PY
