"""Load a llama.cpp GGUF file into a Hugging Face-named state dict.

The header is read by :func:`sloserve.gguf_file.read_gguf_header`, the tensor data memory-mapped;
dequantization goes through the ``gguf`` package (``gguf.quants.dequantize`` for every encoding:
F32/F16/BF16, Q4_0, Q4_1, Q8_0, Q5_x, the K-quants, the IQ types). Tensors are renamed from llama.cpp's names to Hugging
Face's, and the Q/K rows of the ``llama`` architecture are un-permuted (llama.cpp's converter
interleaves each head's two RoPE halves; Hugging Face's ``rotate_half`` wants them split).

Public entry points: :func:`read_gguf` (metadata + tensor table), :func:`gguf_to_config`,
:func:`load_gguf_state_dict`, :func:`load_gguf_tokenizer`, :func:`gguf_model_name`.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sloserve.model.config import ModelConfig
from sloserve.gguf_file import GGUFError, GGUFTensorInfo, gguf_version, read_gguf_header

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass
class GGUFFile:
    """A GGUF file: its header (:func:`sloserve.gguf_file.read_gguf_header`) and its tensor data
    memory-mapped on first use.

    Attributes:
        path: absolute path of the file.
        metadata: every key/value; scalars as Python numbers/bools/str, arrays as lists.
        tensors: tensor table in file order, keyed by llama.cpp name.
        byte_order: ``"<"`` or ``">"`` (a big-endian file's float tensors are swapped on read).
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    byte_order: str = "<"
    _data: np.ndarray | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``"llama"``, ``"qwen2"``)."""
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes, memory-mapped: uint8 of shape (rows..., bytes per
        row), the layout ``gguf.quants.dequantize`` takes.

        Raises:
            KeyError: no tensor of that name.
        """
        info = self.tensors[name]
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        rows = info.shape[:-1] or (1,)
        return self._data[info.offset:info.offset + info.nbytes].reshape(*rows, -1)

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized by ``gguf.quants.dequantize`` to float32, shape ``info.shape``.

        Raises:
            KeyError: no tensor of that name.
            ValueError: the tensor's ggml type cannot be dequantized by the installed ``gguf``.
        """
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        data = self.raw(name)
        swapped = {GGMLQuantizationType.F32: ">f4", GGMLQuantizationType.F16: ">f2"}
        if self.byte_order == ">" and qtype in swapped:
            arr = data.view(swapped[qtype]).astype(np.float32)
        else:
            try:
                arr = dequantize(data, qtype)
            except NotImplementedError as e:
                raise ValueError(f"{self.path}: tensor {name!r} is stored as {qtype.name}, an "
                                 f"unsupported quantization type (gguf {gguf_version()} cannot "
                                 f"dequantize it: {e})") from e
        arr = np.array(arr, dtype=np.float32, order="C").reshape(info.shape)
        return torch.from_numpy(arr)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read a GGUF file's metadata and tensor table (:func:`sloserve.gguf_file.read_gguf_header`).

    Args:
        path: a ``.gguf`` file.

    Returns:
        :class:`GGUFFile`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``"{path} is not a readable GGUF file: ..."``: not a GGUF file, a truncated
            one (where it ends), a corrupt one (which field), an unsupported version or tensor
            type (the :class:`~sloserve.gguf_file.GGUFError` phrase).
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        h = read_gguf_header(path)
    except GGUFError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    return GGUFFile(path=path, metadata=h.metadata, tensors=h.tensors, byte_order=h.byte_order)


# --------------------------------------------------------------------------------------- config

def gguf_to_config(gf: GGUFFile) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys).

    ``tie_word_embeddings`` is True when the file has no ``output.weight``. A llama3-style
    ``rope_freqs.weight`` tensor is turned back into an equivalent Hugging Face llama3 ``rope_scaling``
    (accepted only if it reproduces every stored divisor). ``head_dim`` comes from
    ``attention.key_length``, else from the rows of ``blk.0.attn_q.weight``, else hidden / heads.

    Raises:
        ValueError: architecture other than llama / qwen2, required keys missing, metadata of
            the wrong type or value (a head count of 0), or an unrecognised RoPE scaling; the
            message starts with the file's path.
    """
    try:
        return _gguf_config(gf)
    except ValueError as e:
        if str(e).startswith(gf.path):
            raise
        raise ValueError(f"{gf.path}: {e}") from e
    except (TypeError, ZeroDivisionError, OverflowError) as e:  # e.g. a list where a count goes
        raise ValueError(f"{gf.path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from e


def _gguf_config(gf: GGUFFile) -> ModelConfig:
    md = gf.metadata
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gf.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if required:
            raise ValueError(f"{gf.path}: GGUF metadata key {full!r} is missing")
        return default

    n_heads = int(get("attention.head_count", required=True))
    hidden = int(get("embedding_length", required=True))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; Llama/Qwen2 are uniform
        n_kv = max(n_kv)
    vocab = get("vocab_size")
    if vocab is None:
        if "token_embd.weight" in gf.tensors:
            vocab = gf.tensors["token_embd.weight"].shape[0]
        elif "tokenizer.ggml.tokens" in md:
            vocab = len(md["tokenizer.ggml.tokens"])
        else:
            raise ValueError(f"{gf.path}: cannot determine vocab size")
    head_dim = int(get("attention.key_length", 0) or 0)
    if not head_dim and "blk.0.attn_q.weight" in gf.tensors:
        head_dim = gf.tensors["blk.0.attn_q.weight"].shape[0] // n_heads
    head_dim = head_dim or hidden // n_heads

    cfg: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_eos_ids(md),
        "rope_scaling": _gguf_rope_scaling(gf, get, head_dim),
    }
    return ModelConfig.from_hf_dict(cfg)


def _gguf_eos_ids(md: dict[str, Any]) -> list[int]:
    """eos plus the other end-of-generation ids llama.cpp honours (eot, eom), deduped."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = md.get(key)
        if v is not None and int(v) >= 0 and int(v) not in ids:
            ids.append(int(v))
    return ids


def _llama3_inv_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                             orig_ctx: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` for llama3 RoPE scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    low_wl, high_wl = orig_ctx / low, orig_ctx / high
    smooth = (orig_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out


def _infer_llama3_scaling(freqs: np.ndarray, dim: int, theta: float) -> dict[str, Any] | None:
    """Recover Hugging Face llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors.

    ``factor`` is the largest divisor. For a candidate (low, high) freq factor pair, each divisor
    strictly between 1 and ``factor`` pins ``original_max_position_embeddings`` exactly
    (``smooth = (orig / wavelen - low) / (high - low)``); with none in between, powers of two are
    tried. A candidate is accepted only if it reproduces every divisor.
    """
    fac = float(freqs.max())
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    wavelen = 2 * np.pi / inv_freq
    if wavelen.shape != freqs.shape or fac < 1.0:
        return None
    mid = (freqs > 1.0 + 1e-6) & (freqs < fac - 1e-6 * fac)
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (1.0, 32.0)):
        candidates: list[float] = []
        if mid.any() and fac > 1.0:
            smooth = (1.0 / freqs[mid] - 1.0 / fac) / (1.0 - 1.0 / fac)
            candidates.append(float(np.round(np.median(wavelen[mid] * (smooth * (high - low) + low)))))
        candidates += [float(2 ** k) for k in range(8, 21)]
        for orig in candidates:
            ref = _llama3_inv_freq_factors(dim, theta, fac, low, high, orig)
            if np.allclose(ref, freqs, rtol=1e-4, atol=1e-5):
                return {"rope_type": "llama3", "factor": fac, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": int(orig)}
    return None


def _gguf_rope_scaling(gf: GGUFFile, get, head_dim: int) -> dict[str, Any] | None:
    stype = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if stype == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if stype == "yarn":
        raise ValueError(f"{gf.path}: YaRN RoPE scaling is not supported")
    if "rope_freqs.weight" in gf.tensors:
        freqs = gf.dequantize("rope_freqs.weight").double().numpy().reshape(-1)
        if np.allclose(freqs, 1.0):
            return None
        theta = float(get("rope.freq_base", 10000.0))
        dim = int(get("rope.dimension_count", head_dim))
        scaling = _infer_llama3_scaling(freqs, dim, theta)
        if scaling is None:
            raise ValueError(f"{gf.path}: rope_freqs.weight does not match llama3 RoPE scaling; "
                             "unsupported RoPE scaling")
        return scaling
    return None


# ----------------------------------------------------------------------------------- tensors

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_IGNORED = {"rope_freqs.weight"}  # folded into config.rope_scaling


def gguf_name_to_hf(name: str) -> str | None:
    """Map a llama.cpp tensor name to the Hugging Face Llama/Qwen2 name.

    Returns:
        e.g. ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for
        tensors that have no HF parameter (``rope_freqs.weight``).

    Raises:
        ValueError: a tensor name this loader does not know.
    """
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name in _IGNORED:
        return None
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unknown GGUF tensor {name!r} (not a Llama/Qwen2 weight)")


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp ``convert_hf_to_gguf.py``'s ``permute(w, n_head, n_head_kv)`` on Q or K.

    llama.cpp stores each head's rows as interleaved pairs (GPT-J RoPE layout); Hugging Face's
    ``rotate_half`` wants the first half of the head's rows then the second half.

    Args:
        w: ``(n_head * head_dim, in_features)`` weight or ``(n_head * head_dim,)`` bias.
        n_head: heads this tensor holds (query heads for Q, key/value heads for K).

    Returns:
        Tensor of the same shape with rows reordered.

    Raises:
        ValueError: rows not divisible into ``n_head`` heads of even size.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot un-permute {tuple(w.shape)} into {n_head} heads of even size")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def is_quantizable(hf_name: str) -> bool:
    """The weights the quantized path serves: every linear projection, the embedding and the
    LM head (norm weights and biases stay float)."""
    return hf_name.endswith("_proj.weight") or hf_name in ("model.embed_tokens.weight",
                                                           "lm_head.weight")


def _rope_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order :func:`unpermute_rope` gives, as indices (new row i = old row idx[i])."""
    return unpermute_rope(torch.arange(rows).unsqueeze(1), n_head).squeeze(1)


def load_gguf_quantized(gf: GGUFFile, config: ModelConfig, mode: str = "gguf") -> dict[str, Any]:
    """The linear weights of ``gf`` as :class:`~sloserve.model.quant.QuantizedWeight`s (HF names).

    ``mode``: ``gguf`` keeps each tensor's stored encoding where it maps exactly (Q4_0/Q4_1/Q8_0,
    Q5_x, the K-quants) and requantizes the rest (float tensors, IQ types) to int8; ``int8`` /
    ``int4`` requantize every weight from its float values.

    Raises:
        ValueError: an unknown mode.
    """
    from gguf import GGMLQuantizationType

    from sloserve.model import quant
    if mode not in ("gguf", "int8", "int4"):
        raise ValueError(f"quantization must be gguf, int8 or int4, got {mode!r}")
    permute = gf.architecture == "llama"

    def one(name: str, info) -> Any:
        hf = gguf_name_to_hf(name)
        tname = GGMLQuantizationType(info.ggml_type).name
        qw = None
        if mode == "gguf":
            try:
                qw = quant.from_gguf(raw_bytes(gf, name), tname, info.shape)
            except ValueError:
                qw = None
        if qw is None:
            dense = gf.dequantize(name)
            qw = (quant.quantize_int4 if mode == "int4" else quant.quantize_int8)(dense, tname)
        if permute and ".self_attn.q_proj." in hf:
            qw = qw.select_rows(_rope_rows(info.shape[0], config.num_attention_heads))
        elif permute and ".self_attn.k_proj." in hf:
            qw = qw.select_rows(_rope_rows(info.shape[0], config.num_key_value_heads))
        return qw

    todo = [(name, info, gguf_name_to_hf(name)) for name, info in gf.tensors.items()]
    todo = [(n, i, hf) for n, i, hf in todo
            if hf is not None and is_quantizable(hf) and len(i.shape) == 2]
    # numpy and torch let go of the GIL in the conversions: one tensor per CPU at a time
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
        done = list(ex.map(lambda t: one(t[0], t[1]), todo))
    return {hf: qw for (_, _, hf), qw in zip(todo, done)}


def raw_bytes(gf: GGUFFile, name: str) -> np.ndarray:
    """Tensor ``name``'s stored bytes (memory-mapped), uint8."""
    return gf.raw(name)


def load_gguf_state_dict(gf: GGUFFile, config: ModelConfig,
                         dtype: torch.dtype = torch.float32,
                         skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of ``gf`` into a Hugging Face-named state dict.

    Args:
        gf: parsed file from :func:`read_gguf`.
        config: its config (from :func:`gguf_to_config`; heads are used for the Q/K un-permute).
        dtype: dtype of the returned tensors (dequantization itself is float32).
        skip: HF names to leave out (the caller has them, e.g. from the quantized weights).

    Returns:
        ``{hf_name: tensor}``, shapes as in Hugging Face (e.g. q_proj ``(H*head_dim, hidden)``);
        no ``lm_head.weight`` when embeddings are tied.

    Raises:
        ValueError: unknown tensor names or types that cannot be dequantized.
    """
    permute = gf.architecture == "llama"
    out: dict[str, torch.Tensor] = {}
    for name in gf.tensors:
        hf = gguf_name_to_hf(name)
        if hf is None or hf in skip:
            continue
        t = gf.dequantize(name)
        if permute and ".self_attn.q_proj." in hf:
            t = unpermute_rope(t, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in hf:
            t = unpermute_rope(t, config.num_key_value_heads)
        out[hf] = t if t.dtype == dtype else t.to(dtype)
    return out


# --------------------------------------------------------------------------------- tokenizer / name

_QUANT_SUFFIX = re.compile(r"^(.+?)[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_model_name(gf: GGUFFile) -> str:
    """Served model name: the file stem minus a trailing quantization tag
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``); falls back to
    ``general.name`` / ``general.basename`` if the stem is empty."""
    stem = os.path.basename(gf.path)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    m = _QUANT_SUFFIX.match(stem)
    if m:
        stem = m.group(1)
    return stem or str(gf.metadata.get("general.name") or gf.metadata.get("general.basename") or "model")


def load_gguf_tokenizer(gf: GGUFFile, config: ModelConfig):
    """Build a :class:`sloserve.tokenizer.Tokenizer` from the GGUF's ``tokenizer.*`` metadata
    via transformers' own GGUF tokenizer conversion (offline, nothing written to disk).

    Raises:
        ValueError: the file carries no tokenizer (``tokenizer.ggml.tokens`` missing).
    """
    from sloserve.tokenizer import Tokenizer

    if "tokenizer.ggml.tokens" not in gf.metadata:
        raise ValueError(f"{gf.path} carries no tokenizer (tokenizer.ggml.tokens missing)")
    return Tokenizer.from_gguf(gf.path, extra_eos_token_ids=config.eos_token_ids,
                               chat_template=gf.metadata.get("tokenizer.chat_template"))
