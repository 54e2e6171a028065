"""Write a draft model for ``--speculative-config '{"method": "draft_model", ...}'``: the
embedded SmolLM2-135M's first N layers (its embeddings, final norm and LM head) as a Hugging Face
folder (float32 safetensors, config.json, the tokenizer): the same vocabulary as the served
model, its own weights and KV cache. There is no smaller SmolLM2 to draft with; this is the
draft the repository can build offline (tests/spec_decode/test_lossless.py builds the same).

    .venv/bin/python -m sloserve.tools.draft_checkpoint N FOLDER
"""
from __future__ import annotations

import argparse
import os
import sys


def write_draft_checkpoint(num_layers: int, folder: str, dtype: str = "float32",
                           loaded=None) -> str:
    """The embedded model's first ``num_layers`` layers in ``folder`` (weights in ``dtype``);
    returns the folder. ``loaded``: (a loaded ``LlamaForCausalLM`` of the embedded model with
    its dense weights, its ``Tokenizer``) to take them from instead of reading the GGUF again
    (its fused Q/K/V and gate/up split back into Hugging Face's names).

    Raises:
        ValueError: a layer count outside the model's.
    """
    import torch
    import transformers
    from safetensors.torch import save_file
    if loaded is None or any(p.is_meta for p in loaded[0].parameters()):
        # (a model served only from its quantized weights holds no dense copy to take)
        from sloserve.model.loader import load_weights
        w = load_weights(None, dtype, with_tokenizer=loaded is None)
        c, state = w.config, w.state_dict
        tokenizer = w.tokenizer if loaded is None else loaded[1]
    else:
        model, tokenizer = loaded
        c, state = model.config, _hf_state_dict(model, getattr(torch, dtype))
    if not 1 <= num_layers <= c.num_hidden_layers:
        raise ValueError(f"N must be in [1, {c.num_hidden_layers}], got {num_layers}")
    os.makedirs(folder, exist_ok=True)
    transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_ids).save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers},
              os.path.join(folder, "model.safetensors"))
    tokenizer.hf.save_pretrained(folder)
    return folder


def _hf_state_dict(model, dtype) -> dict:
    """A loaded model's dense weights under Hugging Face's names (the fused Q/K/V and gate/up
    split by their parts' sizes; no ``lm_head.weight`` when tied)."""
    c = model.config
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    out = {}
    for name, t in model.state_dict().items():
        t = t.to(dtype)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        elif "rotary" not in name:
            out[name] = t
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("num_layers", type=int)
    p.add_argument("folder")
    a = p.parse_args(argv)
    try:
        print(write_draft_checkpoint(a.num_layers, a.folder))
    except ValueError as e:
        print(f"draft_checkpoint: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
