"""The lecture's worked numbers, reproduced exactly, and where its units slip.

Textbook shortcuts (weights only, Williams et al. roofline): a decode step of batch ``B`` through a
model of ``P`` parameters stored in ``w`` bytes each does ``2 P B`` FLOP and reads ``P w`` bytes,
so its intensity is ``2B / w`` FLOP/byte (= B for fp16); a prefill of ``T`` tokens has intensity
``T`` (fp16). The full per-operator model in :mod:`sloserve.roofline.ops` adds attention and KV
traffic on top of this.

Two unit slips in the text, which this module prints exactly:

1. A 32K-token (32,768) Llama-3-70B context holds 327,680 x 32,768 = 10,737,418,240 bytes of fp16
   KV = **10.00 GiB = 10.74 GB**. The text prints "10.48 GB": 327,680 x 32,000 = 10,485,760,000
   bytes, i.e. "32K" read as 32,000 tokens instead of 32,768 (and cut, not rounded, to two
   decimals). Equivalently 10 x 1.024**2 GB: the MiB->MB factor (1.024**2) applied where GiB->GB
   needs 1.024**3 = 1.073741824.
2. The 14.0 ms TPOT bound for Llama-3-70B at TP=8 on H100 (128 x 4096 tokens of KV, 80%
   bandwidth efficiency) is (17.5 GB weights + 20 GB KV) / (3.35 TB/s x 0.8) = 13.99 ms. But the KV
   per GPU is 20 **GiB** = 21.47 GB, so the bound is (17.5 + 21.47) GB / 2.68 TB/s = **14.54 ms**
   (68.8 tokens/s per user instead of 71.5).

Naive (unfused) attention for sequence ``N``, head dim ``d``, fp16: the ``N x N`` score matrix is
``2 N**2`` bytes per head (128 MiB at N = 8192). With ``4 N**2 d`` FLOP (QK^T and PV) against three
``N x N`` passes over HBM (write S; softmax reads S; PV reads the normalized scores), intensity is
``4 N**2 d / (3 x 2 N**2) = 2d/3`` = 85.3 FLOP/byte at d = 128 -- below every GPU's balance point,
whatever N is. Counting a fourth pass (softmax writing P separately) gives d/2; ``passes`` selects.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from sloserve.roofline.hardware import HARDWARE
from sloserve.roofline.kv import kv_bytes_per_token
from sloserve.roofline.models import PRESETS
from sloserve.roofline.roofline import roofline_point
from sloserve.roofline.units import GB, TB, GiB, MiB


def decode_intensity_weights_only(batch: int, weight_bytes: float = 2) -> float:
    """``2 P B / (P w) = 2B / w`` FLOP/byte."""
    return 2 * batch / weight_bytes


def prefill_intensity_weights_only(tokens: int, weight_bytes: float = 2) -> float:
    """``2 P T / (P w) = 2T / w`` FLOP/byte."""
    return 2 * tokens / weight_bytes


def weight_bytes(params: float, bytes_per_param: float = 2, tp: int = 1) -> float:
    """``params x bytes / tp`` (70e9 fp16 -> 140 GB; 17.5 GB per GPU at TP=8)."""
    return params * bytes_per_param / tp


@dataclass(frozen=True)
class LectureRow:
    """One row of the lecture's roofline table (weights-only model, fp16).

    Units: intensity FLOP/byte, attainable FLOP/s, mfu fraction, time seconds (lower bound).
    """

    label: str
    hardware: str
    params_per_gpu: float
    phase: str
    tokens: int
    intensity: float
    attainable: float
    mfu: float
    bound: str
    time: float

    def to_dict(self) -> dict:
        return asdict(self)


LECTURE_ROWS = [  # (label, hardware, params per GPU, phase, batch or prompt tokens)
    ("8B decode B=1", "H100-SXM", 8e9, "decode", 1),
    ("8B decode B=16", "H100-SXM", 8e9, "decode", 16),
    ("8B decode B=128", "H100-SXM", 8e9, "decode", 128),
    ("8B decode B=256", "H100-SXM", 8e9, "decode", 256),
    ("8B prefill 1024", "H100-SXM", 8e9, "prefill", 1024),
    ("70B/8 decode B=1", "A100-SXM-80GB", 70e9 / 8, "decode", 1),
    ("70B/8 prefill 1024", "A100-SXM-80GB", 70e9 / 8, "prefill", 1024),
]


def lecture_table() -> list[LectureRow]:
    """The 7-row table: 8B on one H100, Llama-3-70B split 8 ways (TP=8) on A100s, fp16 weights."""
    rows = []
    for label, hw_name, p, phase, t in LECTURE_ROWS:
        # 2 P t FLOP over 2 P bytes of fp16 weights: intensity t (decode: batch, prefill: tokens)
        rp = roofline_point(2 * p * t, 2 * p, HARDWARE[hw_name], "fp16")
        rows.append(LectureRow(label, hw_name, p, phase, t, rp.intensity, rp.attainable, rp.mfu,
                               rp.bound, rp.time))
    return rows


@dataclass(frozen=True)
class NaiveAttention:
    """Per head: score matrix bytes, FLOP, HBM bytes for the N x N passes, intensity FLOP/byte."""

    seq_len: int
    head_dim: int
    score_bytes: float
    flops: float
    bytes_moved: float
    intensity: float


def naive_attention(seq_len: int = 8192, head_dim: int = 128, elem_bytes: float = 2,
                    passes: int = 3) -> NaiveAttention:
    """Unfused attention for one head (see module docstring; 2d/3 at ``passes=3``, fp16)."""
    s = seq_len**2 * elem_bytes
    flops = 4 * seq_len**2 * head_dim
    return NaiveAttention(seq_len, head_dim, s, flops, passes * s, flops / (passes * s))


def unit_slips() -> dict[str, dict[str, float]]:
    """The two slips, exact values next to the text's (bytes, GiB, GB, seconds, tokens/s)."""
    kv32k = kv_bytes_per_token(PRESETS["Llama-3-70B"], "fp16") * 32768
    h100 = HARDWARE["H100-SXM"]
    w = weight_bytes(70e9, 2, 8)
    kv_gpu = 20 * GiB
    text_t = (w + 20 * GB) / (h100.mem_bandwidth * 0.8)
    exact_t = (w + kv_gpu) / (h100.mem_bandwidth * 0.8)
    return {
        "kv_32k_70b": {"bytes": kv32k, "GiB": kv32k / GiB, "GB": kv32k / GB,
                       "text_bytes": kv_bytes_per_token(PRESETS["Llama-3-70B"], "fp16") * 32000,
                       "text_GB": 10.48},
        "tpot_70b_tp8_h100": {"weights_bytes_per_gpu": w, "kv_bytes_per_gpu": kv_gpu,
                              "efficiency": 0.8, "text_seconds": text_t, "exact_seconds": exact_t,
                              "text_user_tokens_per_s": 1 / text_t,
                              "exact_user_tokens_per_s": 1 / exact_t},
    }


def golden_numbers() -> dict[str, float]:
    """Every worked number of the lecture, computed (units in the key names)."""
    h100, a100 = HARDWARE["H100-SXM"], HARDWARE["A100-SXM-80GB"]
    l8, l70 = PRESETS["Llama-3-8B"], PRESETS["Llama-3-70B"]
    kv70 = kv_bytes_per_token(l70, "fp16") * 128 * 4096
    att = naive_attention()
    dec1 = decode_intensity_weights_only(1)
    dec128 = decode_intensity_weights_only(128)
    return {
        "h100_balance_flop_per_byte": h100.balance_point("fp16"),
        "a100_balance_flop_per_byte": a100.balance_point("fp16"),
        "decode_b1_intensity_flop_per_byte": dec1,
        "decode_b1_h100_attainable_flop_per_s": min(h100.peak("fp16"), dec1 * h100.mem_bandwidth),
        "decode_b1_h100_mfu": min(h100.peak("fp16"), dec1 * h100.mem_bandwidth) / h100.peak("fp16"),
        "decode_b128_h100_mfu": min(h100.peak("fp16"), dec128 * h100.mem_bandwidth) / h100.peak("fp16"),
        "prefill_1024_intensity_flop_per_byte": prefill_intensity_weights_only(1024),
        "llama3_8b_kv_bytes_per_token": kv_bytes_per_token(l8, "fp16"),
        "llama3_70b_kv_bytes_per_token": kv_bytes_per_token(l70, "fp16"),
        "kv_128x4096_70b_GiB": kv70 / GiB,
        "kv_128x4096_70b_per_gpu_tp8_GiB": kv70 / 8 / GiB,
        "weights_70b_fp16_GB": weight_bytes(70e9) / GB,
        "weights_70b_fp16_per_gpu_tp8_GB": weight_bytes(70e9, tp=8) / GB,
        "decode_70b_b1_a100_2TBps_s": weight_bytes(70e9) / (2 * TB),
        "naive_attention_8192_score_MiB": att.score_bytes / MiB,
        "naive_attention_8192_intensity_flop_per_byte": att.intensity,
    }
