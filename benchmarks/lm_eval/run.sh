#!/usr/bin/env bash
# lm-evaluation-harness against `sloserve serve` (local-completions, the server's own /tokenize),
# compared sample by sample with lm-eval's Hugging Face backend on the same weights (the embedded
# GGUF, dequantized to float32). Run from the repository root:
#   OUT=/tmp/lm_eval bash benchmarks/lm_eval/run.sh
# SERVE_ARGS: the server's flags (default: the same float32 weights as the HF backend);
# SKIP_HF=1 compares with the stored reference (benchmarks/lm_eval/reference_hf.json) instead.
set -euo pipefail
OUT=${OUT:-/tmp/lm_eval}; PORT=${PORT:-8321}
PY=${PY:-.venv/bin/python}; LM=${LM:-.venv/bin/lm_eval}
SERVE_ARGS=${SERVE_ARGS:---dtype float32 --quantization none}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
G=$($PY -c "import sloserve.embedded as e; print(e.default_model_path())")
TASKS=(--tasks sloserve_mc,sloserve_gen --include_path benchmarks/lm_eval/tasks --log_samples)
REF=benchmarks/lm_eval/reference_hf.json
if [ -z "${SKIP_HF:-}" ]; then
  echo "lm-eval hf backend (float32) ..."
  $LM --model hf --model_args "pretrained=$(dirname "$G"),gguf_file=$(basename "$G"),dtype=float32" \
      --batch_size 1 "${TASKS[@]}" --output_path "$OUT/hf" > "$OUT/hf.log" 2>&1
  REF="$OUT/hf"
fi
echo "sloserve serve $SERVE_ARGS ..."
# shellcheck disable=SC2086
.venv/bin/sloserve serve --port "$PORT" $SERVE_ARGS > "$OUT/server.log" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
$LM --model local-completions \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=SmolLM2-135M-Instruct,tokenizer_backend=remote,num_concurrent=4,max_retries=1" \
    "${TASKS[@]}" --output_path "$OUT/sloserve" > "$OUT/sloserve.log" 2>&1
grep -A6 "^|   Tasks" "$OUT/hf.log" 2>/dev/null | sed 's/^/hf:       /' || true
grep -A6 "^|   Tasks" "$OUT/sloserve.log" | sed 's/^/sloserve: /'
$PY benchmarks/lm_eval/compare.py "$OUT/sloserve" "$REF" ${TOL:+--tol $TOL} | tee "$OUT/compare.txt"
