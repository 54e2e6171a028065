"""Greedy agreement of the int8 KV cache with the engine's own dtype cache, on the embedded model.

Each setting generates 48 greedy tokens for the same 16 chat prompts, one engine at a time
(batched as the engine batches them); the table gives, per setting against the bf16 engine with
a bf16 cache, the position of the first token that differs in each prompt and how many prompts
agree on all tokens. The float32 engine is there for scale: it differs from bf16 by rounding
alone, so its agreement is what "as close as another dtype" means.

    .venv/bin/python benchmarks/kv_int8_agreement.py [--tokens 48] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

from sloserve import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?", "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "What is the difference between a virus and a bacterium?", "Summarize the plot of Hamlet.",
    "Why is the sky blue?", "Suggest a name for a black cat.",
    "What is 17 times 23?", "Describe a sunset in one sentence.",
    "What are the three states of matter?", "Write a limerick about a programmer.",
]
SETTINGS = {"bf16 engine, bf16 KV": dict(dtype="bfloat16"),
            "bf16 engine, int8 KV": dict(dtype="bfloat16", kv_cache_dtype="int8"),
            "fp32 engine, fp32 KV": dict(dtype="float32"),
            "fp32 engine, int8 KV": dict(dtype="float32", kv_cache_dtype="int8")}


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out")
    a = ap.parse_args()
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    outs = {}
    for name, kw in SETTINGS.items():
        llm = LLM(**kw)
        tok = llm.tokenizer
        ids = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in PROMPTS]
        outs[name] = [list(o.token_ids) for o in llm.generate(ids, sp)]
        del llm
    base = outs["bf16 engine, bf16 KV"]
    rows = {}
    print(f"| setting (vs bf16 engine, bf16 KV) | prompts agreeing on all {a.tokens} tokens | "
          f"first difference per prompt | median |")
    print("|---|---:|---|---:|")
    for name, toks in outs.items():
        if toks is base:
            continue
        fd = [first_difference(x, y) for x, y in zip(toks, base)]
        rows[name] = fd
        print(f"| {name} | {sum(f == a.tokens for f in fd)} / {len(fd)} | "
              f"{', '.join(map(str, fd))} | {statistics.median(fd):.0f} |")
    fp = [first_difference(x, y) for x, y in zip(outs["fp32 engine, int8 KV"],
                                                    outs["fp32 engine, fp32 KV"])]
    rows["fp32 int8 KV vs fp32 KV"] = fp
    print(f"| fp32 engine: int8 KV vs fp32 KV | {sum(f == a.tokens for f in fp)} / {len(fp)} | "
          f"{', '.join(map(str, fp))} | {statistics.median(fp):.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": a.tokens, "first_difference": rows, "outputs": outs}, f)


if __name__ == "__main__":
    main()
