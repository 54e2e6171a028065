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
# vLLM CPU 0.32 beside it (ONLY=vllm-colocated,vllm-pd; needs $PEERS/venv-vllm, see
# ../shared/peers.md): `vllm-colocated` = one vLLM server on both CPUs; `vllm-pd` = P and D
# `taskset` one CPU each with --kv-transfer-config, vLLM's serial proxy flow in front
# (benchmarks/vllm_pd/proxy.py, unpinned or FRONT_CPUS), the same client, workloads and seeds.
# Connector (VLLM_KV): `nixl` = NixlConnector (pull, kv_buffer_device cpu, UCX) with NIXL from
# NIXL_PATH (`pip install --no-deps --target $PEERS/nixl nixl==1.5.1 nixl-cu12==1.5.1`: no CUDA
# needed on a CPU host, the venv is left alone); `example` = ExampleConnector through files in
# /dev/shm (only whole 128-token blocks: D recomputes the rest); `auto` (default): nixl where
# NIXL_PATH imports. With nixl, benchmarks/vllm_pd/sitecustomize.py keeps NIXL from moving P's
# forward thread onto CPU 1 (it pins it to "the last core of the NUMA node"), and NIXL's UCX
# progress thread busy-polls beside each instance's forward on its one CPU (~0.4-0.7 of a CPU
# while idle; vLLM's default, left as is). VLLM_ARGS adds serve flags (e.g. --enforce-eager:
# starts in ~30 s instead of ~2 min, ~20 % slower decode).
#
#   bash benchmarks/pd.sh     # OUT=/tmp/pd MODE=push|pull GRAN=layerwise|eager FLOW=concurrent|serial TRANSPORT=tcp|shm
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pd}; MODE=${MODE:-push}; GRAN=${GRAN:-layerwise}; FLOW=${FLOW:-concurrent}; TRANSPORT=${TRANSPORT:-tcp}
SEED=${SEED:-7}; ONLY=${ONLY:-colocated,pd}; FRONT_CPUS=${FRONT_CPUS:-}
PIN=""
S_IN=${S_IN:-128}; S_OUT=${S_OUT:-64}; S_RATE=${S_RATE:-0.4}; S_N=${S_N:-60}
L_IN=${L_IN:-2048}; L_OUT=${L_OUT:-8}; L_RATE=${L_RATE:-0.04}; L_N=${L_N:-6}
M_N=${M_N:-40}; M_RATE=${M_RATE:-0.8}
SLO1=${SLO1:-"ttft:1000 tpot:50"}; SLO2=${SLO2:-"ttft:2000 tpot:100"}; TIGHT=${TIGHT:-"tpot:15"}
PEERS=${PEERS:-/tmp/peers}; VPY=${VPY:-$PEERS/venv-vllm/bin/python}
VLLM_CLI=${VLLM_CLI:-$PEERS/scripts/vllm_cli.py}; VLLM_MODEL=${VLLM_MODEL:-$PEERS/models/smollm2-hf}
NIXL_PATH=${NIXL_PATH:-$PEERS/nixl}; VLLM_KV=${VLLM_KV:-auto}; VLLM_ARGS=${VLLM_ARGS:-}
mkdir -p "$OUT"
PIDS=""; VGROUPS=""; VENV_PYTHONPATH=""
stop_vllm() {  # the vLLM servers' process groups (setsid): TERM, 60 s, then KILL what is left
  for g in $VGROUPS; do kill -TERM -- "-$g" 2>/dev/null; done
  for g in $VGROUPS; do
    for _ in $(seq 60); do kill -0 -- "-$g" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$g" 2>/dev/null
  done
  VGROUPS=""
}
cleanup() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; stop_vllm; wait 2>/dev/null; }
trap cleanup EXIT
health() { for _ in $(seq "${2:-900}"); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
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
stop_all() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; stop_vllm; wait 2>/dev/null; PIDS=""; }
vstart() {  # log-name cpus port args...  (a vLLM server in its own process group; sets SPID)
  local log=$1 cpus=$2 port=$3; shift 3
  local pin=() bind=0-1
  [ -n "$cpus" ] && pin=(taskset -c "$cpus") && bind=$cpus
  # shellcheck disable=SC2086
  env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND="$bind" \
    ${VENV_PYTHONPATH:+PYTHONPATH="$VENV_PYTHONPATH"} setsid "${pin[@]}" "$VPY" "$VLLM_CLI" serve \
    "$VLLM_MODEL" --host 127.0.0.1 --port "$port" --dtype bfloat16 --max-model-len 4096 \
    $VLLM_ARGS "$@" >"$OUT/$log.log" 2>&1 &
  SPID=$!; VGROUPS="$VGROUPS $SPID"
}
has_vllm() {
  [ -x "$VPY" ] && [ -f "$VLLM_CLI" ] && [ -d "$VLLM_MODEL" ] && return 0
  echo "pd.sh: skipping $1: no vLLM venv/wrapper/model at $VPY, $VLLM_CLI, $VLLM_MODEL" >&2
  return 1
}

if [[ ",$ONLY," == *",colocated,"* ]]; then
  start colocated "" --port 8311
  health 8311 && workloads 8311 colocated
  stop_all
fi
if [[ ",$ONLY," == *",pd,"* ]]; then
  KV='"kv_connector_extra_config": {"mode": "'$MODE'", "granularity": "'$GRAN'", "transport": "'$TRANSPORT'"}'
  start prefill 0 --port 8312 --step-trace "$OUT/pd-prefill-steps.jsonl" \
    --kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14611, '"$KV"'}'
  start decode 1 --port 8313 --step-trace "$OUT/pd-decode-steps.jsonl" \
    --kv-transfer-config '{"kv_role": "kv_consumer", "kv_port": 14612, '"$KV"'}'
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
  # where D's decode-step tail comes from: warm-up after idle vs a long prompt's KV arriving
  .venv/bin/python benchmarks/pd_itl_tail.py --decode-trace "$OUT/pd-decode-steps.jsonl" \
    --prefill-trace "$OUT/pd-prefill-steps.jsonl" >"$OUT/pd-step-tail.txt" 2>&1
fi
if [[ ",$ONLY," == *",vllm-colocated,"* ]] && has_vllm vllm-colocated; then
  vstart vllm-colocated "" 8317
  health 8317 2400 && workloads 8317 vllm-colocated
  stop_all
fi
if [[ ",$ONLY," == *",vllm-pd,"* ]] && has_vllm vllm-pd; then
  if [ "$VLLM_KV" = auto ]; then
    VLLM_KV=example
    PYTHONPATH="$NIXL_PATH" "$VPY" -c 'import nixl._api' 2>/dev/null && VLLM_KV=nixl
  fi
  SHM=""
  if [ "$VLLM_KV" = nixl ]; then
    VENV_PYTHONPATH="$PWD/benchmarks/vllm_pd:$NIXL_PATH"
    VKV='"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"'
    P_KV='{'"$VKV"', "kv_role": "kv_producer"}'; D_KV='{'"$VKV"', "kv_role": "kv_consumer"}'
  else
    SHM=/dev/shm/pd-vllm-kv-$$; mkdir -p "$SHM"; VENV_PYTHONPATH=""
    P_KV='{"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": "'$SHM'"}}'
    D_KV=$P_KV
  fi
  echo "pd.sh: vllm-pd with $VLLM_KV: P $P_KV, D $D_KV" | tee "$OUT/vllm-pd-config.txt" >&2
  VLLM_NIXL_SIDE_CHANNEL_PORT=5611 vstart vllm-prefill 0 8315 --kv-transfer-config "$P_KV"
  VLLM_NIXL_SIDE_CHANNEL_PORT=5612 vstart vllm-decode 1 8316 --kv-transfer-config "$D_KV"
  VENV_PYTHONPATH=""
  if health 8315 2400 && health 8316 2400; then
    [ -n "$FRONT_CPUS" ] && PIN="taskset -c $FRONT_CPUS"
    $PIN "$VPY" benchmarks/vllm_pd/proxy.py --port 8314 --prefill http://127.0.0.1:8315 \
      --decode http://127.0.0.1:8316 >"$OUT/vllm-proxy.log" 2>&1 &
    PIDS="$PIDS $!"
    health 8314 && workloads 8314 vllm-pd
    PIN=""
    curl -s localhost:8316/metrics | grep -E '^vllm:nixl_(xfer_time_seconds_(sum|count)|bytes_transferred_(sum|count)|num_failed)' \
      >"$OUT/vllm-pd-decode-kv-metrics.txt"
  fi
  stop_all
  [ -n "$SHM" ] && rm -rf "$SHM"
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
for setup in ("colocated", "pd", "vllm-colocated", "vllm-pd"):
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
