#!/bin/bash
# Prefix-aware routing: two replicas (`taskset` one CPU each) behind `sloserve router` with
# --routing-policy prefix-aware (from the replicas' KV cache events) and round-robin, and one
# engine (both CPUs) alone, on `shared-prefix` with PREFIX_GROUPS system prompts; the same client and
# seed. Prints mean / P99 TTFT and the prefix-cache hit rate over the run (prefix_cache_hits /
# queries summed over the servers, vLLM's token counters).
#
#   bash benchmarks/router_prefix.sh     # OUT=/tmp/router_prefix PREFIX_GROUPS=4 N=80 RATE=2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/router_prefix}; NGROUPS=${PREFIX_GROUPS:-4}; N=${N:-80}; RATE=${RATE:-2}; SEED=${SEED:-5}
PLEN=${PLEN:-1024}; SLEN=${SLEN:-64}; OLEN=${OLEN:-16}
mkdir -p "$OUT"
PIDS=""
trap 'for p in $PIDS; do kill -INT $p 2>/dev/null; done; wait 2>/dev/null' EXIT
health() { for _ in $(seq 900); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
counter() {  # metric ports...
  local n=$1 s=0 v; shift
  for p in "$@"; do
    v=$(curl -s "localhost:$p/metrics" | awk -v n="$n" '$1 ~ "^"n"(\\{|$)" {s += $2} END {print s + 0}')
    s=$(python3 -c "print($s + $v)")
  done
  echo "$s"
}
serve() {  # log cpus port [args]
  local log=$1 cpus=$2 port=$3; shift 3
  if [ -n "$cpus" ]; then set -- taskset -c "$cpus" .venv/bin/sloserve serve --port "$port" "$@"
  else set -- .venv/bin/sloserve serve --port "$port" "$@"; fi
  "$@" --log-level warning >"$OUT/$log.log" 2>&1 &
  PIDS="$PIDS $!"
}
stop_all() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; wait 2>/dev/null; PIDS=""; }
run() {  # name front-port server-ports...
  local name=$1 port=$2; shift 2
  .venv/bin/sloserve bench --port "$port" --dataset-name random --random-input-len 256 \
    --random-output-len 4 --num-prompts 4 --seed 999 >/dev/null 2>&1   # warm-up, other text
  local q0 h0 q1 h1
  q0=$(counter vllm:prefix_cache_queries_total "$@"); h0=$(counter vllm:prefix_cache_hits_total "$@")
  .venv/bin/sloserve bench --port "$port" --dataset-name shared-prefix --prefix-num-groups "$NGROUPS" \
    --prefix-len "$PLEN" --prefix-suffix-len "$SLEN" --prefix-output-len "$OLEN" --num-prompts "$N" \
    --request-rate "$RATE" --seed "$SEED" --save-result --result-dir "$OUT" \
    --result-filename "$name.json" >"$OUT/$name.txt" 2>&1
  q1=$(counter vllm:prefix_cache_queries_total "$@"); h1=$(counter vllm:prefix_cache_hits_total "$@")
  python3 -c "
import json; d = json.load(open('$OUT/$name.json')); q = $q1 - $q0; h = $h1 - $h0
print(f'| $name | {d[\"mean_ttft_ms\"]:,.0f} | {d[\"p99_ttft_ms\"]:,.0f} | {d[\"completed\"]} | ' + (f'{h / q:.1%}' if q else '-') + ' |')" | tee -a "$OUT/table.md"
}
echo "| setup | mean TTFT (ms) | P99 TTFT (ms) | completed | hit rate (tokens) |" | tee "$OUT/table.md"
echo "|---|---:|---:|---:|---:|" | tee -a "$OUT/table.md"

serve one "" 8321
health 8321 && run one-engine 8321 8321
stop_all

EV='{"enable_kv_cache_events": true, "endpoint": "tcp://*:PORT"}'
for policy in prefix-aware round-robin; do
  serve replica-a 0 8322 --kv-events-config "${EV/PORT/5571}"
  serve replica-b 1 8323 --kv-events-config "${EV/PORT/5572}"
  health 8322 && health 8323
  .venv/bin/sloserve router --port 8320 --replicas http://127.0.0.1:8322 http://127.0.0.1:8323 \
    --routing-policy "$policy" --kv-events-endpoints tcp://127.0.0.1:5571 tcp://127.0.0.1:5572 \
    --log-level warning >"$OUT/router-$policy.log" 2>&1 &
  PIDS="$PIDS $!"
  health 8320 && run "two-replicas-$policy" 8320 8322 8323
  stop_all
done
