#!/bin/bash
# Speculative decoding on and off, the same client (sloserve bench, HTTP only) and seeds: per
# server configuration, batch 1 on `copy` (greedy, EOS on), batch 1 on `random --ignore-eos`,
# batch 1 on a natural chat set (the generate_until prompts of benchmarks/lm_eval/data/gen.jsonl
# as chat messages, EOS on, at most 128 tokens) and c=16 on `copy`; prints mean TPOT, output
# tok/s and, from /metrics, the drafts' acceptance over each run. One server at a time.
#
#   bash benchmarks/spec_decode.sh        # OUT=/tmp/spec_decode N1=10 N16=32 ROUNDS=1
#   CONFIGS="off ngram4" RUNS="copy-c16" bash benchmarks/spec_decode.sh   # some of the runs
# A configuration is `off`, `ngramK` (ngram, k = K, prompt_lookup_max 4), `suffixK` (suffix,
# k = K), `layerskipN` (layer_skip, the first N layers, k = 3), `draftN` (draft_model: the
# embedded model's first N layers written as a Hugging Face folder under $OUT, k = 3) or `llama-TYPE`:
# llama.cpp's server (PEERS=/tmp/peers, ../shared/peers.md) with `--spec-type TYPE` (`none`: off)
# on LLAMA_GGUF (default: the embedded model's Q4_1 GGUF, the file sloserve serves); on an AMX host
# run with LLAMA_ARG_REPACK=0 (its AMX repack dies of SIGILL there, see "Against vLLM and llama.cpp").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spec_decode}; N1=${N1:-10}; N16=${N16:-32}; ROUNDS=${ROUNDS:-1}
PORT=${PORT:-8293}; CONFIGS=${CONFIGS:-"off ngram4"}; PEERS=${PEERS:-/tmp/peers}
RUNS=${RUNS:-"copy-c1 random-c1 chat-c1 copy-c16"}
LLAMA_GGUF=${LLAMA_GGUF:-$(.venv/bin/python -c 'from sloserve.embedded import default_model_path; print(default_model_path())')}
mkdir -p "$OUT"
# the natural chat set as a ShareGPT file (prompt, a placeholder answer: the length is the flag's)
.venv/bin/python -c "
import json, sys
rows = [json.loads(l) for l in open('benchmarks/lm_eval/data/gen.jsonl')]
json.dump([{'conversations': [{'from': 'human', 'value': r['prompt']},
                              {'from': 'gpt', 'value': r['answer']}]} for r in rows],
          open('$OUT/chat.json', 'w'))"
counter() { curl -s "localhost:$PORT/metrics" | awk -v n="$1" '$1 ~ "^"n"(\\{|$)" {s += $2} END {print s + 0}'; }
bench() {  # name, then sloserve bench flags
  local name=$1; shift
  local d0 t0 a0; d0=$(counter vllm:spec_decode_num_drafts_total)
  t0=$(counter vllm:spec_decode_num_draft_tokens_total); a0=$(counter vllm:spec_decode_num_accepted_tokens_total)
  .venv/bin/sloserve bench --port "$PORT" --seed 5 --save-result --result-dir "$OUT" \
    --result-filename "$name.json" --disable-tqdm "$@" >"$OUT/$name.txt" 2>&1
  local d1 t1 a1; d1=$(counter vllm:spec_decode_num_drafts_total)
  t1=$(counter vllm:spec_decode_num_draft_tokens_total); a1=$(counter vllm:spec_decode_num_accepted_tokens_total)
  python3 -c "
import json; d = json.load(open('$OUT/$name.json')); dr, t, a = $d1 - $d0, $t1 - $t0, $a1 - $a0
acc = f'{a / t:.1%}, {1 + a / dr:.2f}' if t else '-'
print(f'| $name | {d[\"mean_tpot_ms\"]:.2f} | {d[\"output_throughput\"]:.1f} | {d[\"completed\"]} | {acc} |')" | tee -a "$OUT/table.md"
}
echo "| run | mean TPOT (ms) | output tok/s | completed | draft acceptance, mean acceptance length |" | tee "$OUT/table.md"
echo "|---|---:|---:|---:|---|" | tee -a "$OUT/table.md"
for r in $(seq "$ROUNDS"); do
  for c in $CONFIGS; do
    case $c in
      llama-*)  # llama.cpp's server on the same weights' GGUF, its own n-gram speculation
        spec=(); [ "${c#llama-}" != none ] && spec=(--spec-type "${c#llama-}")
        "$PEERS/llama.cpp-src/build/bin/llama-server" -m "$LLAMA_GGUF" --host 127.0.0.1 \
          --port "$PORT" -t 2 -np 16 -c 16384 --metrics "${spec[@]}" >"$OUT/serve-$c-$r.log" 2>&1 &
        ;;
      *)
        spec=()
        case $c in
          ngram*) spec=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": ${c#ngram}, \"prompt_lookup_max\": 4}") ;;
          suffix*) spec=(--speculative-config "{\"method\": \"suffix\", \"num_speculative_tokens\": ${c#suffix}}") ;;
          layerskip*) spec=(--speculative-config "{\"method\": \"layer_skip\", \"num_speculative_tokens\": 3, \"num_draft_layers\": ${c#layerskip}}") ;;
          draft*)
            [ -d "$OUT/$c" ] || .venv/bin/python -m sloserve.tools.draft_checkpoint "${c#draft}" "$OUT/$c"
            spec=(--speculative-config "{\"method\": \"draft_model\", \"num_speculative_tokens\": 3, \"model\": \"$OUT/$c\"}") ;;
        esac
        .venv/bin/sloserve serve --port "$PORT" --log-level info "${spec[@]}" >"$OUT/serve-$c-$r.log" 2>&1 &
        ;;
    esac
    pid=$!
    for _ in $(seq 600); do curl -sf "localhost:$PORT/health" >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.5; done
    .venv/bin/sloserve bench --port "$PORT" --dataset-name random --random-input-len 64 \
      --random-output-len 8 --num-prompts 2 --seed 999 --disable-tqdm >/dev/null 2>&1  # warm-up
    for run in $RUNS; do
      case $run in
        copy-c1) bench "$c-copy-c1-r$r" --dataset-name copy --num-prompts "$N1" --max-concurrency 1 ;;
        random-c1) bench "$c-random-c1-r$r" --dataset-name random --random-input-len 128 \
          --random-output-len 64 --ignore-eos --num-prompts "$N1" --max-concurrency 1 ;;
        chat-c1) bench "$c-chat-c1-r$r" --dataset-name sharegpt --dataset-path "$OUT/chat.json" \
          --sharegpt-output-len 128 --backend openai-chat --endpoint /v1/chat/completions \
          --num-prompts 10 --max-concurrency 1 ;;
        copy-c16) bench "$c-copy-c16-r$r" --dataset-name copy --num-prompts "$N16" --max-concurrency 16 ;;
      esac
    done
    kill -INT $pid; wait $pid
  done
done
