#!/bin/bash
# `sloserve sim` against a measured 1P + 1D run on this host (issue 35: within 20 % on mean TTFT
# and P99 TPOT). 1P + 1D as in benchmarks/pd.sh (`taskset` one CPU each, layer-wise push over
# 127.0.0.1, `sloserve router` in front), both servers writing step traces. A calibration run
# (`mixed`, seed CAL_SEED) fits the cost model (`sloserve profile --from-trace` on both
# instances' traces) and the server path (the calibration run's mean TTFT over its own
# simulation's); a held-out run (other seed and arrivals) is measured, then simulated with
# both (`--num-prefill-instances 1 --num-decode-instances 1`, layer-wise) on a link of each
# KV_LINKS rate in turn (127.0.0.1 has no rate of its own: the figures should not depend on it
# once it is well above the prefill's KV rate, which the two rates check). Prints both and
# the relative errors.
#
#   bash benchmarks/pd_fidelity.sh     # OUT=/tmp/pd_fidelity N=40 RATE=0.8 SEED=9 CAL_SEED=31 KV_LINKS="2gbit 20gbit"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pd_fidelity}; N=${N:-40}; RATE=${RATE:-0.8}; SEED=${SEED:-9}; CAL_SEED=${CAL_SEED:-31}
KV_LINKS=${KV_LINKS:-"2gbit 20gbit"}
WL=(--dataset-name mixed --mixed-scale 0.25 --num-prompts "$N" --request-rate "$RATE" --ignore-eos)
mkdir -p "$OUT"
PIDS=""
stop_all() { for p in $PIDS; do kill -INT "$p" 2>/dev/null; done; wait 2>/dev/null; PIDS=""; }
trap stop_all EXIT
health() { for _ in $(seq 900); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
run_pd() {  # name seed
  local name=$1 seed=$2
  KV='"kv_connector_extra_config": {"mode": "push", "granularity": "layerwise"}'
  taskset -c 0 .venv/bin/sloserve serve --port 8312 --log-level warning --step-trace "$OUT/$name-p.jsonl" \
    --kv-transfer-config '{"kv_role": "kv_producer", "kv_port": 14611, '"$KV"'}' >"$OUT/$name-p.log" 2>&1 &
  PIDS="$PIDS $!"
  taskset -c 1 .venv/bin/sloserve serve --port 8313 --log-level warning --step-trace "$OUT/$name-d.jsonl" \
    --kv-transfer-config '{"kv_role": "kv_consumer", "kv_port": 14612, '"$KV"'}' >"$OUT/$name-d.log" 2>&1 &
  PIDS="$PIDS $!"
  health 8312 && health 8313
  .venv/bin/sloserve router --port 8310 --prefill http://127.0.0.1:8312 --decode http://127.0.0.1:8313 \
    --log-level warning >"$OUT/$name-router.log" 2>&1 &
  PIDS="$PIDS $!"
  health 8310
  .venv/bin/sloserve bench --port 8310 --dataset-name random --random-input-len 512 --random-output-len 8 \
    --num-prompts 4 --seed 999 >/dev/null 2>&1
  .venv/bin/sloserve bench --port 8310 "${WL[@]}" --seed "$seed" --save-result --save-detailed \
    --result-dir "$OUT" --result-filename "$name.json" >"$OUT/$name.txt" 2>&1
  stop_all
}
run_pd calibration "$CAL_SEED"
run_pd measured "$SEED"
.venv/bin/sloserve profile --from-trace "$OUT/calibration-p.jsonl" "$OUT/calibration-d.jsonl" \
  --out "$OUT/profile.json" >"$OUT/profile.txt" 2>&1
sim() {  # seed link result [args]
  local seed=$1 link=$2 res=$3; shift 3
  .venv/bin/sloserve sim --profile "$OUT/profile.json" --num-prefill-instances 1 \
    --num-decode-instances 1 --kv-transfer-mode layerwise --kv-transfer-link "$link" "${WL[@]}" \
    --seed "$seed" --save-result "$OUT/$res.json" "$@" >"$OUT/$res.txt" 2>&1
}
# the server's own path (client -> router -> both API processes -> engine, and the tokens
# back) is not in the step traces: its mean is what the calibration run's mean TTFT has over
# its simulation, charged to every request as --request-in-ms
first=${KV_LINKS%% *}
sim "$CAL_SEED" "$first" simulated-calibration
PATH_MS=$(.venv/bin/python -c 'import json, sys
m, s = (json.load(open(f))["mean_ttft_ms"] for f in sys.argv[1:])
print(round(max(0.0, m - s), 1))' "$OUT/calibration.json" "$OUT/simulated-calibration.json")
for link in $KV_LINKS; do
  sim "$SEED" "$link" "simulated-$link" --request-in-ms "$PATH_MS"
done
.venv/bin/python - "$OUT" "$PATH_MS" $KV_LINKS <<'PY' | tee "$OUT/table.md"
import json, os, sys
out, path_ms, links = sys.argv[1], sys.argv[2], sys.argv[3:]
load = lambda f: json.load(open(os.path.join(out, f)))  # noqa: E731
m, sims = load("measured.json"), [load(f"simulated-{x}.json") for x in links]
print(f"server path from the calibration run: {path_ms} ms per request")
print("| metric | measured | " + " | ".join(f"simulated, {x} link (error)" for x in links) + " |")
print("|---|---:|" + "---:|" * len(links))
for label, k in (("mean TTFT (ms)", "mean_ttft_ms"), ("P99 TTFT (ms)", "p99_ttft_ms"),
                 ("P50 TPOT (ms)", "median_tpot_ms"), ("P99 TPOT (ms)", "p99_tpot_ms")):
    print(f"| {label} | {m[k]:.1f} | " + " | ".join(
        f"{s[k]:.1f} ({(s[k] - m[k]) / m[k]:+.1%})" for s in sims) + " |")
PY
