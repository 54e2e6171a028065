#!/bin/bash
# Prefix-aware routing: two replicas (`taskset` one CPU each) behind `sloserve router` with
# --routing-policy prefix-aware (from the replicas' KV cache events) and round-robin, and one
# engine (both CPUs) alone, on `shared-prefix` with PREFIX_GROUPS system prompts; the same client and
# seed. Prints mean / P99 TTFT and the prefix-cache hit rate over the run (prefix_cache_hits /
# queries summed over the servers, vLLM's token counters).
# Then a peer router's `cache_aware` in front of the same two replicas, one row per name in
# PEER_ROUTERS (default "sglang vllm"; "" for none), each from PEER_ROUTER_VENV (default
# /tmp/peers/venv-router) and skipped with a printed line where it is not installed there; its
# version and command line head its log. Install lines (sglang-router 0.3.2, vllm-router 0.1.17 tried):
#   python3 -m venv /tmp/peers/venv-router && /tmp/peers/venv-router/bin/pip install sglang-router
#   python3 -m venv /tmp/peers/venv-router && /tmp/peers/venv-router/bin/pip install vllm-router
#
#   bash benchmarks/router_prefix.sh     # OUT=/tmp/router_prefix PREFIX_GROUPS=4 N=80 RATE=2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/router_prefix}; NGROUPS=${PREFIX_GROUPS:-4}; N=${N:-80}; RATE=${RATE:-2}; SEED=${SEED:-5}
PLEN=${PLEN:-1024}; SLEN=${SLEN:-64}; OLEN=${OLEN:-16}
mkdir -p "$OUT"
PIDS=""; BENCH_ARGS=()
trap 'for p in $PIDS; do kill -INT $p 2>/dev/null; done; wait 2>/dev/null' EXIT
health() { for _ in $(seq 900); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
ready() {  # port workers: a peer router's /health is 200 before it has registered its workers
  for _ in $(seq 120); do
    curl -sf "localhost:$1/readiness" | grep -q "\"healthy_workers\":$2[,}]" && return 0; sleep 0.5
  done; return 1
}
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
    --random-output-len 4 --num-prompts 4 --seed 999 ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
    >/dev/null 2>&1   # warm-up, other text
  local q0 h0 q1 h1
  q0=$(counter vllm:prefix_cache_queries_total "$@"); h0=$(counter vllm:prefix_cache_hits_total "$@")
  .venv/bin/sloserve bench --port "$port" --dataset-name shared-prefix --prefix-num-groups "$NGROUPS" \
    --prefix-len "$PLEN" --prefix-suffix-len "$SLEN" --prefix-output-len "$OLEN" --num-prompts "$N" \
    --request-rate "$RATE" --seed "$SEED" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --save-result \
    --result-dir "$OUT" --result-filename "$name.json" >"$OUT/$name.txt" 2>&1
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

# Peer routers: cache_aware (an approximate prefix tree of the prompts' text per worker, no KV
# events) with the sloserve router's prefix-aware thresholds (both peers' defaults too).
PV=${PEER_ROUTER_VENV:-/tmp/peers/venv-router}
for peer in ${PEER_ROUTERS-sglang vllm}; do
  case $peer in sglang|vllm) dist=$peer-router ;; *) echo "peer router $peer: unknown (sglang, vllm), skipped"; continue ;; esac
  ver=$("$PV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$dist" 2>/dev/null) \
    || { echo "peer router $peer: $dist not installed in $PV, skipped"; continue; }
  name="two-replicas-$dist-cache_aware"
  serve replica-a 0 8322 --kv-events-config "${EV/PORT/5571}"
  serve replica-b 1 8323 --kv-events-config "${EV/PORT/5572}"
  health 8322 && health 8323
  # sglang-router's /v1/models lists its own "unknown" model (sloserve has no /get_model_info):
  # the client asks for the replicas' model and tokenizer by name, as it finds them behind ours.
  models=$(curl -s localhost:8322/v1/models | python3 -c 'import json, sys
m = json.load(sys.stdin)["data"][0]; print(m["id"]); print(m.get("root") or "")')
  BENCH_ARGS=(--model "$(sed -n 1p <<<"$models")"); root=$(sed -n 2p <<<"$models")
  [ -e "$root" ] && BENCH_ARGS+=(--tokenizer "$root")
  if [ "$peer" = sglang ]; then set -- -m sglang_router.launch_router --log-level warn
  else set -- -m vllm_router.launch_router --log-level warning; fi
  set -- "$PV/bin/python" "$@" --host 127.0.0.1 --port 8320 --worker-urls http://127.0.0.1:8322 \
    http://127.0.0.1:8323 --policy cache_aware --cache-threshold 0.3 --balance-abs-threshold 64 \
    --balance-rel-threshold 1.5 --prometheus-host 127.0.0.1 --prometheus-port 29320
  echo "$dist $ver: $*" | tee "$OUT/router-$dist-cache_aware.log"
  "$@" >>"$OUT/router-$dist-cache_aware.log" 2>&1 &
  PIDS="$PIDS $!"
  ready 8320 2 && run "$name" 8320 8322 8323
  stop_all; BENCH_ARGS=()
done
