"""The one seam through which weights enter the engine.

``load_weights(path, dtype, load_format)`` returns a :class:`LoadedWeights` (config, Hugging Face-named
state dict, tokenizer, served name) from a GGUF file, a Hugging Face safetensors folder, or a
``config.json`` with random ("dummy") weights. ``load_model`` wraps it into a ready
``sloserve.model.llama.LlamaForCausalLM``.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sloserve.model.config import ModelConfig
from sloserve.tokenizer import Tokenizer
from sloserve.tokenizer import resolve_model_source, single_gguf as _single_gguf
from sloserve.tokenizer import load_model_tokenizer as _load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from sloserve.model.llama import LlamaForCausalLM

from sloserve.config import QUANTIZATION_CHOICES as QUANTIZATIONS  # noqa: E402

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedWeights:
    """Everything a loader produces.

    Attributes:
        config: model architecture.
        state_dict: Hugging Face parameter names (``model.embed_tokens.weight``,
            ``model.layers.{i}.self_attn.q_proj.weight``, ...; no ``lm_head.weight`` when tied)
            -> CPU tensors already cast to the requested dtype; exactly :func:`expected_state_dict_keys`.
        tokenizer: the model's tokenizer; None only for a dummy load without tokenizer files.
        name: served model name (GGUF: file stem without the quant tag, e.g.
            ``SmolLM2-135M-Instruct``; folder: its basename).
        source: resolved absolute path that was loaded.
        quantized: HF name -> QuantizedWeight of every linear weight, the embedding and the LM
            head, when the weights are served quantized (empty otherwise); the state dict then
            holds their dequantized values, or with ``dense_quantized=False`` a placeholder on
            the meta device (the model dequantizes it if and when a step needs it:
            ``LlamaForCausalLM.materialize_dense``).
        quantization: what was applied: ``none``, ``gguf`` (as stored), ``int8``, ``int4``.
    """

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    name: str
    source: str
    quantized: dict = field(default_factory=dict)
    quantization: str = "none"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (also ``fp32``, ``bf16``, ``fp16``, ``half``, ``torch.``-prefixed)
    or one of those torch dtypes -> torch dtype.

    Raises:
        ValueError: anything else (message names the allowed values).
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _ALLOWED_DTYPES:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed: 'float32', 'bfloat16', 'float16' "
                     "(or torch.float32 / torch.bfloat16 / torch.float16)")


def parse_kv_cache_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A KV cache dtype: :func:`parse_dtype`'s, or ``"int8"`` / ``torch.int8`` (codes and a scale
    per head and token, ``sloserve.model.attention.kv_int8``).

    Raises:
        ValueError: anything else.
    """
    if dtype == torch.int8 or (isinstance(dtype, str) and dtype.strip().lower() == "int8"):
        return torch.int8
    return parse_dtype(dtype)


def expected_state_dict_keys(config: ModelConfig) -> list[str]:
    """The exact parameter names of ``LlamaForCausalLM(config)`` (Hugging Face naming), in a fixed order."""
    keys = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        keys.append(p + "input_layernorm.weight")
        for proj in ("q", "k", "v", "o"):
            keys.append(f"{p}self_attn.{proj}_proj.weight")
            if config.attention_bias and proj != "o":
                keys.append(f"{p}self_attn.{proj}_proj.bias")
        keys.append(p + "post_attention_layernorm.weight")
        for proj in ("gate", "up", "down"):
            keys.append(f"{p}mlp.{proj}_proj.weight")
    keys.append("model.norm.weight")
    if not config.tie_word_embeddings:
        keys.append("lm_head.weight")
    return keys


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` for :func:`expected_state_dict_keys` (``(out_features, in_features)`` for linears)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for k in expected_state_dict_keys(config):
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            s: tuple[int, ...] = (v, d)
        elif k.endswith("layernorm.weight") or k == "model.norm.weight":
            s = (d,)
        elif ".q_proj." in k:
            s = (q, d) if k.endswith("weight") else (q,)
        elif ".k_proj." in k or ".v_proj." in k:
            s = (kv, d) if k.endswith("weight") else (kv,)
        elif ".o_proj." in k:
            s = (d, q)
        elif ".down_proj." in k:
            s = (d, f)
        else:  # gate / up
            s = (f, d)
        shapes[k] = s
    return shapes


def validate_state_dict(sd: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Check names and shapes against ``config``.

    Raises:
        ValueError: missing / unexpected keys or a wrong shape (up to 5 of each listed).
    """
    shapes = expected_shapes(config)
    missing = [k for k in shapes if k not in sd]
    unexpected = [k for k in sd if k not in shapes]
    bad = [f"{k}: {tuple(sd[k].shape)} != {shapes[k]}" for k in shapes
           if k in sd and tuple(sd[k].shape) != shapes[k]]
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} ({', '.join(unexpected[:5])}"
                         f"{', ...' if len(unexpected) > 5 else ''})")
        if bad:
            parts.append(f"wrong shape {len(bad)} ({'; '.join(bad[:5])})")
        raise ValueError(f"weights in {source} do not match the config: " + "; ".join(parts))


def dummy_state_dict(config: ModelConfig, dtype: torch.dtype = torch.float32,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for ``config``: every matrix/bias ~ N(0, 0.02) (drawn in float32 from a
    ``torch.Generator`` seeded with ``seed``, in :func:`expected_state_dict_keys` order, then cast),
    every RMSNorm weight = 1.0. Same seed -> same weights, whatever ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for k, shape in expected_shapes(config).items():
        if k.endswith("norm.weight"):
            sd[k] = torch.ones(shape, dtype=dtype)
        else:
            sd[k] = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g).to(dtype)
    return sd


def load_model_tokenizer(path: str | None, load_format: str = "auto") -> Tokenizer | None:
    """The tokenizer of the model at ``path`` alone, without reading its weights
    (:func:`sloserve.tokenizer.load_model_tokenizer`, what the API process loads), after the
    checks the weights' loader makes: from a GGUF's metadata, or a folder's tokenizer files;
    None for a dummy model without tokenizer files.

    A file or folder the weights' loader would refuse is refused here with the same one-line
    message (what the file is, what is wrong): a folder's config.json is checked before its
    tokenizer loads; a GGUF whose tokenizer does not load is read by
    :func:`~sloserve.model.gguf_loader.read_gguf` to say why.

    Raises:
        FileNotFoundError: the path (or a hf folder's config.json or tokenizer files) does not
            exist.
        ValueError: unknown load format, a config.json that is not JSON, misses a required key
            or names an unsupported architecture, a truncated / corrupt GGUF file, or no
            tokenizer can be built from the file (every message names the file).
    """
    source, fmt = resolve_model_source(path, load_format)
    if fmt != "gguf":
        from sloserve.model import hf_loader as hl
        folder = source if os.path.isdir(source) else os.path.dirname(source)
        hl.read_hf_config(source if fmt == "dummy" else folder)  # its errors name the file
        return _load_tokenizer(source, fmt)
    try:
        return _load_tokenizer(source, fmt)
    except ValueError:  # say why, as the weights' loader would
        from sloserve.model import gguf_loader as gl
        gl.read_gguf(_single_gguf(source))  # "{path} is not a readable GGUF file: ..." if not
        raise  # it carries no tokenizer, or one that cannot be built


def load_weights(path: str | None, dtype: str | torch.dtype = "bfloat16",
                 load_format: str = "auto", with_tokenizer: bool = True,
                 quantization: str = "none", dense_quantized: bool = True) -> LoadedWeights:
    """Load config, weights and tokenizer from ``path``.

    Args:
        path: a ``.gguf`` file, a Hugging Face folder (config.json, *.safetensors, tokenizer files),
            or for ``dummy`` a folder with config.json / a config.json file. None -> :func:`default_model_path`.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or the torch dtype; the state dict is cast to it
            (GGUF tensors are dequantized in float32 first).
        load_format: ``"auto"`` (a .gguf file -> gguf, a folder -> hf, a folder with only one .gguf -> gguf),
            ``"gguf"``, ``"safetensors"`` / ``"hf"``, ``"dummy"`` (random weights, see :func:`dummy_state_dict`;
            tokenizer loaded if the folder has tokenizer files, else None).
        with_tokenizer: False skips the tokenizer (``tokenizer`` is None): the engine core
            needs none, the front end loads its own (:func:`load_model_tokenizer`).
        quantization: ``none`` (dense, the default here), ``gguf`` (a GGUF's weights as stored,
            see ``gguf_loader.load_gguf_quantized``; HF folders have nothing stored quantized
            and stay dense), ``int8`` / ``int4`` (requantize every linear weight), ``auto``
            (``gguf`` for a GGUF file, ``none`` otherwise).
        dense_quantized: False: a GGUF's quantized weights get no dense copy here (their state
            dict entries are meta-device placeholders of the right shape and dtype).

    Returns:
        :class:`LoadedWeights` whose state dict keys are exactly ``expected_state_dict_keys(config)``.

    Raises:
        FileNotFoundError: ``path`` (or config.json / weight files / tokenizer files of an hf folder,
            or the default model package) does not exist.
        ValueError: unknown ``load_format`` or ``quantization``, bad ``dtype``, unsupported
            architecture / tensor type, or weights that do not match the config.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
    torch_dtype = parse_dtype(dtype)
    if path is None and load_format == "dummy":
        raise ValueError("load_format 'dummy' needs a folder with config.json (or a config.json file)")
    source, fmt = resolve_model_source(path, load_format)
    if quantization == "auto":
        quantization = "gguf" if fmt == "gguf" else "none"
    if fmt == "gguf":
        lw = _load_gguf(_single_gguf(source), torch_dtype, with_tokenizer, quantization,
                        dense_quantized)
    elif fmt in ("hf", "safetensors"):
        lw = _load_hf(source, torch_dtype, with_tokenizer)
    else:
        lw = _load_dummy(source, torch_dtype, with_tokenizer)
    if fmt != "gguf" and quantization in ("int8", "int4"):
        _requantize(lw, quantization, torch_dtype)
    validate_state_dict(lw.state_dict, lw.config, lw.source)
    return lw


def _requantize(lw: LoadedWeights, mode: str, dtype: torch.dtype) -> None:
    """Quantize a dense checkpoint's linear weights (``--quantization int8|int4``)."""
    from sloserve.model import quant
    from sloserve.model.gguf_loader import is_quantizable
    fn = quant.quantize_int4 if mode == "int4" else quant.quantize_int8
    sd = lw.state_dict
    if lw.config.tie_word_embeddings is False and "lm_head.weight" not in sd:
        raise ValueError(f"{lw.source}: an untied model without lm_head.weight")
    for name in [n for n in sd if is_quantizable(n)]:
        qw = fn(sd[name], str(sd[name].dtype).removeprefix("torch."))
        lw.quantized[name] = qw
        sd[name] = qw.dequantize().to(dtype)
    lw.quantization = mode


def _load_gguf(path: str, dtype: torch.dtype, with_tokenizer: bool,
               quantization: str, dense_quantized: bool = True) -> LoadedWeights:
    from sloserve.model import gguf_loader as gl

    gf = gl.read_gguf(path)
    config = gl.gguf_to_config(gf)
    qw = gl.load_gguf_quantized(gf, config, quantization) if quantization != "none" else {}
    sd = gl.load_gguf_state_dict(gf, config, dtype, skip=set(qw))
    for name, w in qw.items():  # the dense path computes with exactly the served values
        sd[name] = (w.dequantize().to(dtype) if dense_quantized
                    else torch.empty(w.shape, dtype=dtype, device="meta"))
    tok = gl.load_gguf_tokenizer(gf, config) if with_tokenizer else None
    return LoadedWeights(config, sd, tok, gl.gguf_model_name(gf), gf.path, qw,
                         quantization if qw else "none")


def _load_hf(folder: str, dtype: torch.dtype, with_tokenizer: bool) -> LoadedWeights:
    from sloserve.model import hf_loader as hl

    if not os.path.isdir(folder):
        raise ValueError(f"load_format 'hf'/'safetensors' needs a folder, got file {folder}")
    config, _ = hl.read_hf_config(folder)
    sd = hl.load_hf_state_dict(folder, config, dtype)
    if not hl.has_tokenizer_files(folder):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(hl.TOKENIZER_FILES)}) in {folder}")
    tok = (Tokenizer.from_pretrained(folder, extra_eos_token_ids=config.eos_token_ids)
           if with_tokenizer else None)
    return LoadedWeights(config, sd, tok, hl.hf_model_name(folder), folder)


def _load_dummy(path: str, dtype: torch.dtype, with_tokenizer: bool) -> LoadedWeights:
    from sloserve.model import hf_loader as hl

    config, _ = hl.read_hf_config(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    tok = (Tokenizer.from_pretrained(folder, extra_eos_token_ids=config.eos_token_ids)
           if with_tokenizer and hl.has_tokenizer_files(folder) else None)
    return LoadedWeights(config, dummy_state_dict(config, dtype), tok, hl.hf_model_name(folder), path)


def load_model(path: str | None = None, dtype: str | torch.dtype = "bfloat16", load_format: str = "auto",
               device: str | torch.device | None = None,
               with_tokenizer: bool = True,
               quantization: str = "none",
               dense_quantized: bool = True) -> tuple["LlamaForCausalLM", LoadedWeights]:
    """Build ``sloserve.model.llama.LlamaForCausalLM`` and load weights into it.

    Args:
        path, dtype, load_format, quantization, dense_quantized: as :func:`load_weights`
            (without the dense copies, those parameters stay on the meta device).
        device: optional device to move the model to (default: stay on CPU).

    Returns:
        ``(model in eval mode with parameters in dtype, LoadedWeights)``; the model's parameters are
        copies, so ``LoadedWeights.state_dict`` may be dropped by the caller. Every op runs its
        torch reference until ``sloserve.model.model_loader.use_kernels`` puts it on the kernels.

    Raises:
        everything :func:`load_weights` raises; ValueError from the model's ``load_weights``
        if the model's parameter names disagree.
    """
    from sloserve.model.llama import LlamaForCausalLM  # lazy: the model module is optional here

    lw = load_weights(path, dtype=dtype, load_format=load_format, with_tokenizer=with_tokenizer,
                      quantization=quantization, dense_quantized=dense_quantized)
    torch_dtype = parse_dtype(dtype)
    model = LlamaForCausalLM(lw.config)
    model.allocate(torch_dtype, {n for n, t in lw.state_dict.items() if t.is_meta})
    model = model.to(torch_dtype).eval()  # the buffers (the parameters are in dtype already)
    model.load_weights(lw.state_dict.items(), lw.quantized)
    if device is not None:
        model = model.to(device)
    return model, lw
