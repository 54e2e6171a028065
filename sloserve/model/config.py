"""Architecture description of a decoder-only transformer (Llama family, Qwen2).

One plain dataclass that every loader (GGUF, Hugging Face folder, dummy) fills in, and that the
model, the KV cache sizing and (later) the roofline calculator read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


#: the Hugging Face model classes this engine serves -> the family they are
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2"}


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family / Qwen2 model.

    Attributes:
        architecture: "llama" (Llama 2/3, SmolLM2, Mistral) or "qwen2" (q/k/v projections have bias).
        vocab_size: number of token ids.
        hidden_size: model width d (elements).
        intermediate_size: SwiGLU MLP width (elements).
        num_hidden_layers: transformer blocks.
        num_attention_heads: query heads H.
        num_key_value_heads: key/value heads H_kv (H_kv == H: MHA; 1 < H_kv < H: GQA; 1: MQA).
        head_dim: elements per head (usually hidden_size // num_attention_heads).
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: None, or a dict like Hugging Face's ({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}); "linear" is also accepted.
        max_position_embeddings: the model's context length (tokens).
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        bos_token_id / eos_token_ids: special tokens (eos may be several, Llama 3 has two).
    """

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {v!r}")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (LlamaConfig, MistralConfig, Qwen2Config).

        ``model_type`` names the family (absent: the one ``architectures`` names, else llama);
        ``architectures``, when given, must name a supported class (``HF_ARCHITECTURES``).

        Raises:
            ValueError: not a JSON object; the model_type or architectures name neither
                Llama-family nor Qwen2 (e.g. ``GPT2LMHeadModel``); a required key
                (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
                num_attention_heads) is missing or not a positive integer; head_dim,
                rms_norm_eps or rope_theta of the wrong type.
        """
        if not isinstance(cfg, dict):
            raise ValueError(f"model config: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures")
        if archs is not None and not (isinstance(archs, list)
                                      and all(isinstance(a, str) for a in archs)):
            raise ValueError(f"model config: architectures must be a list of class names, got "
                             f"{archs!r}")
        known = [HF_ARCHITECTURES[a] for a in archs or () if a in HF_ARCHITECTURES]
        model_type = cfg.get("model_type") or (known[0] if known else "llama")
        supported = (f"supported: model_type llama, mistral, qwen2 "
                     f"({', '.join(HF_ARCHITECTURES)})")
        if model_type in ("llama", "mistral"):
            arch = "llama"
        elif model_type == "qwen2":
            arch = "qwen2"
        else:
            named = f" ({', '.join(archs)})" if archs else ""
            raise ValueError(f"unsupported model_type {model_type!r}{named}; {supported}")
        if archs and not known:
            given = f"model_type {cfg['model_type']!r}" if cfg.get("model_type") else "no model_type"
            raise ValueError(f"unsupported architecture {', '.join(archs)} ({given}); {supported}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"model config: missing {', '.join(missing)}")
        for k in ("rms_norm_eps", "rope_theta"):
            if cfg.get(k) is not None and (isinstance(cfg[k], bool)
                                           or not isinstance(cfg[k], (int, float))):
                raise ValueError(f"model config: {k} must be a number, got {cfg[k]!r}")
        hd = cfg.get("head_dim")
        if hd is not None and (isinstance(hd, bool) or not isinstance(hd, int) or hd < 0):
            raise ValueError(f"model config: head_dim must be a positive integer, got {hd!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        n_heads = cfg["num_attention_heads"]
        if not isinstance(n_heads, int) or not isinstance(cfg["hidden_size"], int) or n_heads < 1:
            raise ValueError(f"model config: hidden_size and num_attention_heads must be positive "
                             f"integers, got {cfg['hidden_size']!r} and {n_heads!r}")
        # a sliding attention window (Mistral v0.1's 4096; Qwen2 with use_sliding_window) is not
        # served: the context stops at the window, where full attention equals it
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        context = cfg.get("max_position_embeddings", 4096)
        if isinstance(window, int) and not isinstance(window, bool) and 0 < window < context:
            context = window
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
