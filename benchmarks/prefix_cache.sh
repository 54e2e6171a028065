#!/bin/bash
# Prefix caching side by side: one shared 1,024-token system prompt + 128 unique tokens per
# request, Poisson arrivals, 16 output tokens; sloserve with the cache on and off, and vLLM's CPU
# engine (which caches prefixes by default), one server at a time, the same client (sloserve bench,
# HTTP only) and seed. Prints mean / P99 TTFT and each server's own prefix-cache hit rate
# (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total over the run).
#
#   bash benchmarks/prefix_cache.sh     # OUT=/tmp/prefix_cache PEERS=/tmp/peers RATE=1 N=40
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prefix_cache}; PEERS=${PEERS:-/tmp/peers}; RATE=${RATE:-1}; N=${N:-40}
PORT=${PORT:-8292}; SEED=${SEED:-11}
mkdir -p "$OUT"
counter() { curl -s "localhost:$PORT/metrics" | awk -v n="$1" '$1 ~ "^"n"(\\{|$)" {s += $2} END {print s + 0}'; }
run() {  # name
  local name=$1
  for _ in $(seq 600); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
  # warm-up with other text (compiles / first-use costs), not sharing the measured prefix
  .venv/bin/sloserve bench --port "$PORT" --dataset-name random --random-input-len 256 \
    --random-output-len 4 --num-prompts 4 --seed 999 >/dev/null 2>&1
  local q0 h0; q0=$(counter vllm:prefix_cache_queries_total); h0=$(counter vllm:prefix_cache_hits_total)
  .venv/bin/sloserve bench --port "$PORT" --dataset-name shared-prefix --prefix-num-groups 1 \
    --prefix-len 1024 --prefix-suffix-len 128 --prefix-output-len 16 --num-prompts "$N" \
    --request-rate "$RATE" --seed "$SEED" --save-result --result-dir "$OUT" \
    --result-filename "$name.json" >"$OUT/$name.txt" 2>&1
  local q1 h1; q1=$(counter vllm:prefix_cache_queries_total); h1=$(counter vllm:prefix_cache_hits_total)
  python3 -c "
import json; d = json.load(open('$OUT/$name.json')); q = $q1 - $q0; h = $h1 - $h0
print(f'| $name | {d[\"mean_ttft_ms\"]:,.0f} | {d[\"p99_ttft_ms\"]:,.0f} | {d[\"completed\"]} | ' + (f'{h / q:.1%}' if q else '-') + ' |')" | tee -a "$OUT/table.md"
}
echo "| server | mean TTFT (ms) | P99 TTFT (ms) | completed | hit rate (tokens) |" | tee "$OUT/table.md"
echo "|---|---:|---:|---:|---:|" | tee -a "$OUT/table.md"
for mode in on off; do
  flag=$([ $mode = on ] && echo --enable-prefix-caching || echo --no-enable-prefix-caching)
  .venv/bin/sloserve serve --port "$PORT" --log-level warning $flag >"$OUT/sloserve-$mode.log" 2>&1 &
  pid=$!; run "sloserve-cache-$mode"; kill -INT $pid; wait $pid
done
if [ -x "$PEERS/venv-vllm/bin/python" ]; then
  env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    setsid "$PEERS/venv-vllm/bin/python" "$PEERS/scripts/vllm_cli.py" serve "$PEERS/models/smollm2-hf" \
    --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 4096 \
    --served-model-name smollm2 >"$OUT/vllm.log" 2>&1 &
  pid=$!; run "vllm"; kill -TERM -- -$pid 2>/dev/null || kill $pid; wait $pid
fi
