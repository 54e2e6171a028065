#!/bin/bash
# Prefill/decode disaggregation on this host: colocated (one `sloserve serve`, both CPUs) against
# 1P + 1D (`taskset` one CPU each, the KV over the connector on 127.0.0.1, `sloserve router` in
# front: concurrent flow, layer-wise push by default), the same client (sloserve bench, HTTP only)
# and seeds. Workloads: the compare harness's interference one (short Poisson stream + a 10x rarer
# 2,048-token stream, in parallel) and `mixed`. Prints, per setup, the short requests' P50/P99
# TPOT, P99 and max ITL, mean/P99 TTFT and goodput at SLO1, SLO2 and a tight TPOT limit (TIGHT).
#
# FRONT_CPUS pins the router and the bench client in the 1P + 1D setup (e.g. 0: beside P, as
# a router on its own host would leave D's CPU to D; default: unpinned, as in colocated).
#
#   bash benchmarks/pd.sh     # OUT=/tmp/pd MODE=push|pull GRAN=layerwise|eager FLOW=concurrent|serial
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pd}; MODE=${MODE:-push}; GRAN=${GRAN:-layerwise}; FLOW=${FLOW:-concurrent}
SEED=${SEED:-7}; ONLY=${ONLY:-colocated,pd}; FRONT_CPUS=${FRONT_CPUS:-}
PIN=""
S_IN=${S_IN:-128}; S_OUT=${S_OUT:-64}; S_RATE=${S_RATE:-0.4}; S_N=${S_N:-60}
L_IN=${L_IN:-2048}; L_OUT=${L_OUT:-8}; L_RATE=${L_RATE:-0.04}; L_N=${L_N:-6}
M_N=${M_N:-40}; M_RATE=${M_RATE:-0.8}
SLO1=${SLO1:-"ttft:1000 tpot:50"}; SLO2=${SLO2:-"ttft:2000 tpot:100"}; TIGHT=${TIGHT:-"tpot:15"}
mkdir -p "$OUT"
PIDS=""
cleanup() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
health() { for _ in $(seq 900); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
bench() {  # port name workload [bench args...]
  local port=$1 name=$2 wl=$3; shift 3
  $PIN .venv/bin/sloserve bench --port "$port" --ignore-eos --save-result --save-detailed \
    --result-dir "$OUT" --result-filename "$name-$wl.json" --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,90,99 "$@" >"$OUT/$name-$wl.txt" 2>&1
}
workloads() {  # port name
  local port=$1 name=$2
  bench "$port" "$name" warmup --dataset-name random --random-input-len 512 --random-output-len 8 \
    --num-prompts 4 --seed 999
  bench "$port" "$name" interference-long --dataset-name random --random-input-len "$L_IN" \
    --random-output-len "$L_OUT" --num-prompts "$L_N" --request-rate "$L_RATE" --seed $((SEED + 1)) &
  local lpid=$!
  # shellcheck disable=SC2086
  bench "$port" "$name" interference-short --dataset-name random --random-input-len "$S_IN" \
    --random-output-len "$S_OUT" --num-prompts "$S_N" --request-rate "$S_RATE" --seed "$SEED" \
    --goodput $SLO1
  wait $lpid
  # shellcheck disable=SC2086
  bench "$port" "$name" mixed --dataset-name mixed --mixed-scale 0.25 --num-prompts "$M_N" \
    --request-rate "$M_RATE" --seed $((SEED + 2)) --goodput $SLO1
}
start() {  # log-name cpus args...  (sets SPID)
  local log=$1 cpus=$2; shift 2
  if [ -n "$cpus" ]; then
    taskset -c "$cpus" .venv/bin/sloserve serve --log-level warning "$@" >"$OUT/$log.log" 2>&1 &
  else
    .venv/bin/sloserve serve --log-level warning "$@" >"$OUT/$log.log" 2>&1 &
  fi
  SPID=$!; PIDS="$PIDS $SPID"
}
stop_all() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; wait 2>/dev/null; PIDS=""; }

if [[ ",$ONLY," == *",colocated,"* ]]; then
  start colocated "" --port 8311
  health 8311 && workloads 8311 colocated
  stop_all
fi
if [[ ",$ONLY," == *",pd,"* ]]; then
  KV='"kv_connector_extra_config": {"mode": "'$MODE'", "granularity": "'$GRAN'"}'
  start prefill 0 --port 8312 --kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14611, '"$KV"'}'
  start decode 1 --port 8313 --kv-transfer-config '{"kv_role": "kv_consumer", "kv_port": 14612, '"$KV"'}'
  health 8312 && health 8313
  [ -n "$FRONT_CPUS" ] && PIN="taskset -c $FRONT_CPUS"
  $PIN .venv/bin/sloserve router --port 8310 --prefill http://127.0.0.1:8312 \
    --decode http://127.0.0.1:8313 --kv-transfer-flow "$FLOW" --log-level warning \
    >"$OUT/router.log" 2>&1 &
  PIDS="$PIDS $!"
  health 8310 && workloads 8310 pd
  PIN=""
  curl -s localhost:8313/metrics | grep -E '^sloserve:kv_transfer_(bytes_total|seconds_(sum|count)|failures)' \
    >"$OUT/pd-decode-kv-metrics.txt"
  stop_all
fi

.venv/bin/python - "$OUT" "$SLO1" "$SLO2" "$TIGHT" <<'EOF'
import json, os, sys
out, slos = sys.argv[1], sys.argv[2:]

def parse(s):
    return {k: float(v) / 1e3 for k, v in (x.split(":") for x in s.split())}

def good(d, slo):
    n = 0
    for ttft, itl, olen, err in zip(d["ttfts"], d["itls"], d["output_lens"], d["errors"]):
        if err or ttft is None:
            continue
        tpot = sum(itl) / (olen - 1) if olen > 1 else 0.0
        if ttft <= slo.get("ttft", 1e9) and tpot <= slo.get("tpot", 1e9):
            n += 1
    return n / len(d["ttfts"])

print(f"| setup | workload | P50 / P99 TPOT (ms) | P99 / max ITL (ms) | mean / P99 TTFT (ms) | "
      + " | ".join(f"good @{s}" for s in slos) + " | failed |")
print("|---|---|---:|---:|---:|" + "---:|" * len(slos) + "---:|")
for setup in ("colocated", "pd"):
    for wl in ("interference-short", "mixed"):
        f = os.path.join(out, f"{setup}-{wl}.json")
        if not os.path.exists(f):
            continue
        d = json.load(open(f))
        itls = [x for r in d["itls"] for x in r]
        print(f"| {setup} | {wl} | {d['median_tpot_ms']:.1f} / {d['p99_tpot_ms']:.1f} | "
              f"{d['p99_itl_ms']:.1f} / {max(itls) * 1e3 if itls else 0:.0f} | "
              f"{d['mean_ttft_ms']:.0f} / {d['p99_ttft_ms']:.0f} | "
              + " | ".join(f"{good(d, parse(s)):.0%}" for s in slos)
              + f" | {sum(1 for e in d['errors'] if e)} |")
EOF
