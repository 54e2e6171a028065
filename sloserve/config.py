"""Engine configuration and its command-line flags (vLLM's spelling), in one place.

``EngineConfig`` holds every engine setting and its default; ``add_engine_args`` /
``engine_config_from_args`` are the flags of ``sloserve serve``, ``generate``, ``profile`` and the
simulator's scheduler flags (``add_scheduler_args``), so one default serves them all. The choice
lists of those settings (and the roofline's dtype names) are the constants below, which every
parser and validator imports. Plain Python: no torch; nothing here imports the CLI.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, fields

from sloserve.argtypes import json_object, parse_bandwidth

#: batching modes (the scheduler's SchedulingPolicy): chunked prefill (default), no chunking
#: (``--no-enable-chunked-prefill``), static batches (``--static-batching``)
POLICIES = ("chunked", "naive", "static")
#: ``--distributed-executor-backend`` (vLLM's): where the worker runs
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "ray")
#: ``--scheduling-policy`` (vLLM's): the waiting queue's order
QUEUE_POLICIES = ("fcfs", "priority")
SLO_ADMISSION = ("reject", "defer")
#: ``--prefix-caching-hash-algo`` choices (see sloserve.engine.block_hash)
HASH_ALGOS = ("sha256",)
#: the server flags of each batching mode (for the tools that start servers)
BATCHING_FLAGS = {"chunked": [], "naive": ["--no-enable-chunked-prefill"],
                  "static": ["--static-batching"]}
#: ``--quantization``: as stored / dense / requantized (see EngineConfig.quantization)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")
#: ``--dtype`` (vLLM's spelling; auto: chosen per CPU, ``sloserve.platform.choose_dtype``)
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")
#: ``--kv-cache-dtype``: a dtype, or int8 codes with a scale per head and token
KV_CACHE_DTYPE_CHOICES = (*DTYPE_CHOICES, "int8")
#: ``--load-format`` ("hf" is another name of "safetensors")
LOAD_FORMAT_CHOICES = ("auto", "gguf", "safetensors", "hf", "dummy")
#: ``--attention-backend``: auto, or a backend that ``sloserve.model.attention`` registers
ATTENTION_BACKEND_CHOICES = ("auto", "cpu-paged", "torch-ref")
#: the roofline's and the simulator's dtype names (``sloserve roofline --weight-dtype /
#: --kv-dtype``, ``sloserve sim --dtype``; bytes each in ``sloserve.roofline.kv.DTYPE_BYTES``)
ROOFLINE_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
#: an engine dtype (``--dtype`` or ``--kv-cache-dtype``, resolved) in the roofline's spelling
ROOFLINE_DTYPE_OF = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8"}
#: ``--logprobs-mode`` (vLLM's): what the ``logprobs`` API returns
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
#: the server's default ``--max-request-body-bytes`` (larger bodies get HTTP 413, see
#: ``sloserve.server.body_limit``): ~1000x the embedded model's longest prompt
DEFAULT_MAX_BODY_BYTES = 10 * 2 ** 20
#: ``--engine-stall-timeout`` (s): ten times the longest step expected at the default token
#: budget (512) on a slow CPU: a 512-token prefill step of a 1-2B model in float32 on a loaded
#: 2-core host takes up to a few seconds (SmolLM2-135M's: well under one)
DEFAULT_ENGINE_STALL_TIMEOUT_S = 30.0
#: ``--structured-outputs-compile-timeout`` (CPU s): a grammar that compiles longer fails its
#: requests (400). A JSON schema of 2,000 optional properties took 26 s of CPU on the AMX host
#: (60,034 characters, near the 65,536-character spec limit); ordinary schemas, regexes and
#: choices compile in milliseconds
DEFAULT_COMPILE_TIMEOUT_S = 30.0
#: ``--max-pending-compiles-per-client``: grammars new to the server one client address may
#: have compiling at once (half of the engine core's 4 compile slots)
DEFAULT_MAX_PENDING_COMPILES_PER_CLIENT = 2


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    Attributes:
        model: GGUF file or Hugging Face folder; None = the embedded SmolLM2-135M-Instruct GGUF.
        served_model_name: name in the API (default: the model's own name).
        dtype: "auto" (default: bfloat16 where this CPU's bf16 matmul is native, float32 where it
            is emulated; see sloserve.platform), "bfloat16", "float32" or "float16".
        kv_cache_dtype: "auto" (= the chosen dtype), a dtype for the paged KV cache, or "int8"
            (8-bit codes and a float32 scale per head and token: sloserve.model.attention.kv_int8).
        load_format: "auto", "gguf", "safetensors", or "dummy" (random weights from config.json).
        block_size: tokens per KV block.
        kv_cache_memory: GiB for the KV cache (used when num_kv_blocks is None).
        num_kv_blocks: exact number of KV blocks (overrides kv_cache_memory).
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most requests running at once.
        max_model_len: longest prompt + output (tokens); None = the model's context length,
            capped at what the KV cache holds.
        scheduling_policy: "fcfs" (default) or "priority" (lower ``priority`` first; a
            higher-priority request may preempt lower-priority running ones). The old values
            "chunked" / "naive" / "static" still work for one release, with a deprecation notice
            (they set the two fields below).
        enable_chunked_prefill: split prompts into chunks under the token budget (default on;
            off: a prompt is prefilled whole, Orca-style).
        long_prefill_token_threshold: with chunked prefill, at most this many of a request's
            prompt tokens per step (vLLM's flag; 0, the default: no cap but the budget). A
            smaller cap spreads a long prompt over more steps: decodes running beside it see
            shorter gaps, and those that outlive its prefill less of it in their TPOT; its own
            TTFT grows.
        enable_prefill_pacing: with chunked prefill, while requests decode, the prompts longer
            than 4 % of max_model_len share one chunk per step that adds about one decode
            step's time, measured by the engine (default on; off with ttft_slo_ms, whose TTFT
            estimate does not model it; our own flag: see ``sloserve.engine.scheduler``,
            "Prefill pacing").
        static_batching: admit a batch only when nothing runs (for comparison; our own flag).
        ttft_slo_ms: with it, SLO-aware admission: a request whose estimated TTFT exceeds it is
            rejected at arrival (429) or, with slo_admission "defer", moved behind the
            requests that can still meet it.
        slo_admission: "reject" or "defer" (see ttft_slo_ms).
        max_waiting_requests: past this many waiting requests a new one is rejected (429);
            None: unbounded. (Decided by the front end, see ``engine.admission``.)
        seed: seed of the engine RNG (unseeded sampling requests draw their seeds from it).
        attention_backend: "auto" (the best that runs here) or a registered backend's name.
        num_threads: torch intra-op threads of the engine core, fixed (None: the CPUs the
            process may use, its affinity mask and cgroup quota, one fewer while other
            processes hold the cores; see ``sloserve.cpus.cpu_budget`` and
            ``sloserve.worker.threads``).
        quantization: "auto" (a GGUF's weights as stored, dense bf16/fp32 for HF folders),
            "none" (dense), "gguf" (as stored), "int8" / "int4" (requantize every linear weight).
        enforce_eager: run every step on the model's plain torch path (no fused quantized
            kernels; vLLM's flag for "no compiled graphs").
        enable_prefix_caching: automatic prefix caching (vLLM V1's hash-chained blocks; on).
        prefix_caching_hash_algo: the block hash ("sha256": the same in every process).
        max_logprobs: most ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` a request may
            ask for (vLLM's default 20; over it: HTTP 400 naming the limit).
        engine_stall_timeout: seconds the engine core may go without a word (it publishes after
            every step) while requests sent to it are unfinished before ``/health`` answers
            503; 0: never (``--engine-stall-timeout``; the API process alone reads it).
        structured_outputs_compile_timeout: most CPU seconds one structured-output grammar may
            take to compile (in the engine core's low-priority compile worker, which is killed
            at the limit); its requests then fail with HTTP 400 naming the flag, and so do
            later ones with the same spec. 0: no limit. CPU time, not wall time: a busy server
            leaves the worker little CPU, and that must not fail a grammar.
        max_pending_compiles_per_client: most structured-output grammars new to the server
            that one client (the peer address the API process sees) may have compiling at
            once: a request that would add one more gets HTTP 429 with ``Retry-After``.
            Requests with a spec already compiled, or already compiling for that client, do
            not count. 0: no cap. (The API process decides, see ``engine.admission``.)
        logprobs_mode: "raw_logprobs" (default: log-softmax of the model's logits),
            "processed_logprobs" (after temperature, top-k and top-p), or the logits themselves
            ("raw_logits", "processed_logits"), as vLLM's ``--logprobs-mode``.
        batch_invariant: a request's token ids, logprobs and text do not depend on its
            batch-mates, ``n``, chunking, prefix-cache hits or the thread count (vLLM's
            ``VLLM_BATCH_INVARIANT``; default off, see README "Numerics" for its cost): one
            kernel per op whatever the step's token count, each position's attention always on
            the same row-invariant kernel, the sampler row by row (``sloserve.model.invariant``
            says what each op does). Runs on the CPU kernels only: quantized weights, or dense
            bf16 on the AMX GEMM.
        speculative_config: speculative decoding, vLLM's JSON (text or dict; None: off); see
            :class:`SpeculativeConfig` for the keys and ``sloserve.spec_decode.drafter``
            for what the engine does with them.
        kv_transfer_config: prefill/decode disaggregation, vLLM's JSON (text or dict; None:
            no KV connector); see :class:`KVTransferConfig`.
        distributed_executor_backend: where the worker runs: ``uni`` (in the engine core's
            process, the default) or ``ray`` (in a Ray actor: ``sloserve.executor.ray``).
        ray_address: the Ray cluster to join (``ray``; default: a local one, or the one
            ``RAY_ADDRESS`` names).
        ray_node_ip: place the worker actor on the Ray node with this address (default: where
            Ray puts it).
        kv_events_config: publish the prefix cache's block events (vLLM's JSON:
            ``enable_kv_cache_events``, ``endpoint``, ...; ``sloserve.engine.kv_events``)
            for a prefix-aware router; checked when the engine core starts.
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    kv_cache_memory: float = 1.0
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    enable_prefill_pacing: bool = True
    static_batching: bool = False
    ttft_slo_ms: float | None = None
    slo_admission: str = "reject"
    max_waiting_requests: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    num_threads: int | None = None
    quantization: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    engine_stall_timeout: float = DEFAULT_ENGINE_STALL_TIMEOUT_S
    structured_outputs_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    max_pending_compiles_per_client: int = DEFAULT_MAX_PENDING_COMPILES_PER_CLIENT
    batch_invariant: bool = False
    speculative_config: dict | str | None = None
    kv_transfer_config: dict | str | None = None
    kv_events_config: dict | str | None = None
    distributed_executor_backend: str = "uni"
    ray_address: str | None = None
    ray_node_ip: str | None = None

    @property
    def kv_transfer(self) -> "KVTransferConfig | None":
        """``kv_transfer_config`` parsed (:class:`KVTransferConfig`, or None: no KV connector).
        Raises ValueError for a bad one."""
        return KVTransferConfig.parse(self.kv_transfer_config)

    @property
    def speculative(self):
        """``speculative_config`` parsed (:class:`sloserve.spec_decode.config.SpeculativeConfig`,
        or None). Raises ValueError for a bad one."""
        return SpeculativeConfig.parse(self.speculative_config)

    def __post_init__(self) -> None:
        if self.scheduling_policy in POLICIES:  # the old spelling: one release of grace
            import logging
            new = {"chunked": "--enable-chunked-prefill", "naive": "--no-enable-chunked-prefill",
                   "static": "--static-batching"}[self.scheduling_policy]
            logging.getLogger("sloserve").warning(
                "--scheduling-policy %s is deprecated: use %s (--scheduling-policy is now fcfs|"
                "priority, as in vLLM)", self.scheduling_policy, new)
            self.enable_chunked_prefill = self.scheduling_policy != "naive"
            self.static_batching = self.scheduling_policy == "static"
            self.scheduling_policy = "fcfs"

    @property
    def batching(self) -> str:
        """The scheduler's batching mode: "chunked", "naive" or "static"."""
        if self.static_batching:
            return "static"
        return "chunked" if self.enable_chunked_prefill else "naive"

    def validate(self) -> None:
        """Raise ValueError naming the setting, its value and the allowed range."""
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.long_prefill_token_threshold
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {v!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or \
                self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "max_waiting_requests"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.kv_cache_memory, (int, float))
                and math.isfinite(self.kv_cache_memory) and self.kv_cache_memory > 0):
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, got "
                             f"{self.kv_cache_memory}")
        for name in ("engine_stall_timeout", "structured_outputs_compile_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {v!r}")
        v = self.max_pending_compiles_per_client
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"max_pending_compiles_per_client must be an integer >= 0, got "
                             f"{v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not -2 ** 63 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.ttft_slo_ms is not None and not (
                isinstance(self.ttft_slo_ms, (int, float)) and math.isfinite(self.ttft_slo_ms)
                and self.ttft_slo_ms > 0):
            raise ValueError(f"ttft_slo_ms must be a positive number of ms, got {self.ttft_slo_ms}")
        for name, choices in (("quantization", QUANTIZATION_CHOICES),
                              ("load_format", LOAD_FORMAT_CHOICES),
                              ("attention_backend", ATTENTION_BACKEND_CHOICES),
                              ("scheduling_policy", QUEUE_POLICIES),
                              ("slo_admission", SLO_ADMISSION),
                              ("prefix_caching_hash_algo", HASH_ALGOS),
                              ("logprobs_mode", LOGPROBS_MODES),
                              ("dtype", DTYPE_CHOICES),
                              ("kv_cache_dtype", KV_CACHE_DTYPE_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got "
                                 f"{getattr(self, name)!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got "
                             f"{self.distributed_executor_backend!r}")
        spec = self.speculative  # raises for a bad one
        self.kv_transfer  # raises for a bad one
        if spec is not None and spec.model is not None and not os.path.exists(spec.model):
            raise ValueError(f"speculative_config: the draft model does not exist: {spec.model}")
        if self.batch_invariant:
            # the torch reference's matmuls and SDPA pick their kernels by shape: no
            # batch-invariant path there (sloserve.model.model_loader says the same for weights
            # the kernels cannot serve invariantly)
            if self.enforce_eager:
                raise ValueError("batch_invariant runs on the CPU kernels: it cannot be "
                                 "combined with enforce_eager (the torch reference's products "
                                 "depend on the step's size)")
            if self.attention_backend == "torch-ref":
                raise ValueError("batch_invariant needs the cpu-paged attention backend (or "
                                 "auto), not torch-ref")

    def resolve_kv_cache(self, page_size_bytes: int, available_bytes: int,
                         model_max_len: int) -> tuple[int, int]:
        """(KV blocks, max_model_len): the one check of the cache's capacity and the context.

        Blocks: ``num_kv_blocks``, else the whole blocks of ``page_size_bytes`` (one block over
        all layers, ``KVCacheSpec.page_size_bytes``) that ``available_bytes`` hold (the
        workers' ``determine_available_memory``). max_model_len unset: the model's context
        ``model_max_len`` capped at the cache (a request that can never fit would preempt itself
        for ever). Set: checked against the model's context (as vLLM does: positions past it
        give garbage; ``SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN=1`` allows it, like vLLM's
        ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``) and against the cache.

        Raises:
            ValueError: a cache of no block, or a set max_model_len over the model's context or
                the cache.
        """
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            num_blocks = int(available_bytes // page_size_bytes)
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block of {page_size_bytes} "
                             f"bytes (num_kv_blocks={self.num_kv_blocks}, "
                             f"kv_cache_memory={self.kv_cache_memory} GiB)")
        kv_tokens = num_blocks * self.block_size
        if self.max_model_len is None:
            return num_blocks, min(model_max_len, kv_tokens)
        if (self.max_model_len > model_max_len
                and os.environ.get("SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN", "0") != "1"):
            raise ValueError(
                f"max_model_len={self.max_model_len} tokens is over the model's context of "
                f"{model_max_len} tokens; lower --max-model-len (or set "
                f"SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it)")
        if self.max_model_len > kv_tokens:
            raise ValueError(
                f"max_model_len={self.max_model_len} tokens does not fit the KV cache of "
                f"{num_blocks} blocks x {self.block_size} = {kv_tokens} tokens; "
                f"raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len")
        return num_blocks, self.max_model_len


# ------------------------------------------------------------------ speculative decoding
# ``--speculative-config``: vLLM's JSON, checked once (plain data; no torch).
#
# Keys, as vLLM spells them:
#
# * ``method``: ``ngram`` (prompt lookup: what followed an earlier occurrence of the longest
#   matching suffix n-gram of prompt + output), ``suffix`` (SuffixDecoding: suffix trees over the
#   request's own tokens and over recent outputs of other requests), ``draft_model`` (a smaller
#   model with the same vocabulary, ``model``), ``layer_skip`` (ours: the served model's first
#   ``num_draft_layers`` layers and its LM head).
# * ``num_speculative_tokens`` (k): most draft tokens per request and step; required except for
#   ``suffix`` (default ``suffix_decoding_max_tree_depth``, as vLLM).
# * ``prompt_lookup_min`` (default 1), ``prompt_lookup_max`` (required for ``ngram``): the
#   n-gram lengths tried, longest first.
# * ``suffix_decoding_max_tree_depth`` (24), ``suffix_decoding_max_cached_requests`` (10000; 0:
#   no tree over other requests), ``suffix_decoding_max_spec_factor`` (1.0: at most this many
#   draft tokens per matched token), ``suffix_decoding_min_token_prob`` (0.1: a draft stops
#   where the tree's estimated probability of reaching the next token falls below it).
# * ``model``: the draft model (``draft_model``: a GGUF / Hugging Face path the engine loads,
#   as ``--model``); ``num_draft_layers`` (``layer_skip``).
# * ``draft_sample_method``: ``greedy`` (default: the draft model's argmax) or
#   ``probabilistic`` (drafts sampled from the draft model at the request's temperature,
#   verified by rejection sampling); model methods only.
# * ``num_speculative_tokens_per_batch_size``: ``[[first, last, k], ...]``: k drafts while first
#   to last requests run (0: none; where drafts do not pay at that batch size); other batch
#   sizes take ``num_speculative_tokens``. Without it, k drops with the batch so that a step
#   stays on the quantized kernels (``sloserve.spec_decode.drafter.Drafter``).
#   ``disable_by_batch_size`` (vLLM V0) is taken as ``[[N, inf, 0]]``.
# * ``min_acceptance_rate`` (ours; default: twice the break-even rate of the drafts measured
#   at start-up, ``sloserve.spec_decode.drafter``): a request whose last
#   :data:`ACCEPTANCE_WINDOW` draft tokens were accepted at a lower rate gets no drafts for its
#   next ``ACCEPTANCE_WINDOW`` output tokens, then tries again (0: never off).

SPEC_METHODS = ("ngram", "suffix", "draft_model", "layer_skip")
#: the keys that only some methods take (a key given to another method is refused)
_METHOD_KEYS = {
    "prompt_lookup_min": ("ngram",), "prompt_lookup_max": ("ngram",),
    **{k: ("suffix",) for k in ("suffix_decoding_max_tree_depth",
                                "suffix_decoding_max_cached_requests",
                                "suffix_decoding_max_spec_factor",
                                "suffix_decoding_min_token_prob")},
    "model": ("draft_model",), "num_draft_layers": ("layer_skip",),
    "draft_sample_method": ("draft_model", "layer_skip"),
}
#: the methods whose drafts come from a model run in the worker
MODEL_SPEC_METHODS = ("draft_model", "layer_skip")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
#: most draft tokens per request and step (vLLM's GPU kernels stop at 32 too)
MAX_SPECULATIVE_TOKENS = 32
#: the acceptance floor's window: draft tokens judged together, and output tokens without
#: drafts after a window below the floor
ACCEPTANCE_WINDOW = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int | None = None
    #: ((first, last, k), ...): k drafts per request while first..last requests run (inclusive)
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    num_draft_layers: int | None = None
    draft_sample_method: str = "greedy"
    #: None: from the measured cost of drafts (``Drafter``)
    min_acceptance_rate: float | None = None

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model the worker runs (``draft_model``, ``layer_skip``)."""
        return self.method in MODEL_SPEC_METHODS

    def k_for(self, batch_size: int) -> int:
        """Draft tokens per request in a step with ``batch_size`` running requests."""
        for first, last, k in self.num_speculative_tokens_per_batch_size or ():
            if first <= batch_size <= last:
                return k
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the JSON text, a dict or an instance (None stays None). Raises ValueError
        naming the key, its value and what is allowed."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)} | {"disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPEC_METHODS)}, "
                             f"{'got ' + repr(method) if method is not None else 'missing'}")
        foreign = sorted(k for k in value if k in _METHOD_KEYS and method not in _METHOD_KEYS[k])
        if foreign:
            raise ValueError(f"speculative_config: {', '.join(foreign)} do(es) not apply to "
                             f"method {method}")

        def integer(name, lo, hi=None, default=None):
            v = value.get(name, default)
            if not _is_int(v) or v < lo or (hi is not None and v > hi):
                span = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"speculative_config: {name} must be an integer {span}, "
                                 f"{'got ' + repr(v) if v is not None else 'missing'}")
            return v

        def number(name, lo, hi, default):
            v = value.get(name, default)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"speculative_config: {name} must be a number in [{lo}, {hi}], "
                                 f"got {v!r}")
            return float(v)

        def needs(name, what):
            if value.get(name) is None:
                raise ValueError(f"speculative_config: method {method} needs {name} ({what})")

        depth = integer("suffix_decoding_max_tree_depth", 1, 1024, 24)
        if method == "suffix":
            value.setdefault("num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS))
        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        lo = integer("prompt_lookup_min", 1, default=1)
        hi = value.get("prompt_lookup_max")
        if method == "ngram":
            needs("prompt_lookup_max", "the longest n-gram to match, e.g. 4")
        if hi is not None:
            hi = integer("prompt_lookup_max", 1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) is over "
                                 f"prompt_lookup_max ({hi})")
        model = value.get("model")
        if method == "draft_model":
            needs("model", "the draft model's path")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config: model must be a path, got {model!r}")
        layers = value.get("num_draft_layers")
        if method == "layer_skip":
            needs("num_draft_layers", "how many of the model's first layers draft, e.g. 8")
        if layers is not None:
            layers = integer("num_draft_layers", 1)
        sample = value.get("draft_sample_method", "greedy")
        if sample not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config: draft_sample_method must be one of "
                             f"{', '.join(DRAFT_SAMPLE_METHODS)}, got {sample!r}")
        per = value.get("num_speculative_tokens_per_batch_size")
        off_from = value.get("disable_by_batch_size")
        if off_from is not None:
            off_from = integer("disable_by_batch_size", 1)
            if per is not None:
                raise ValueError("speculative_config: give num_speculative_tokens_per_batch_size "
                                 "or disable_by_batch_size, not both")
            per = [[1, off_from - 1, k]] if off_from > 1 else []
            per.append([off_from, 2**31 - 1, 0])
        if per is not None:
            ok = isinstance(per, list) and all(
                isinstance(r, list) and len(r) == 3 and all(map(_is_int, r))
                and 1 <= r[0] <= r[1] and 0 <= r[2] <= k for r in per)
            if not ok:
                raise ValueError(f"speculative_config: num_speculative_tokens_per_batch_size "
                                 f"must be a list of [first, last, k] (1 <= first <= last, "
                                 f"0 <= k <= num_speculative_tokens = {k}), got {per!r}")
            per = tuple(tuple(r) for r in per)
        return cls(method, k, lo, hi, per,
                   suffix_decoding_max_tree_depth=depth,
                   suffix_decoding_max_cached_requests=integer(
                       "suffix_decoding_max_cached_requests", 0, default=10000),
                   suffix_decoding_max_spec_factor=number(
                       "suffix_decoding_max_spec_factor", 0.0, 1e6, 1.0),
                   suffix_decoding_min_token_prob=number(
                       "suffix_decoding_min_token_prob", 0.0, 1.0, 0.1),
                   model=model, num_draft_layers=layers, draft_sample_method=sample,
                   min_acceptance_rate=None if value.get("min_acceptance_rate") is None
                   else number("min_acceptance_rate", 0.0, 1.0, None))

    def to_dict(self) -> dict:
        """The JSON object :meth:`parse` takes back (the keys of this method only)."""
        d = {k: v for k, v in asdict(self).items()
             if v is not None and self.method in _METHOD_KEYS.get(k, (self.method,))}
        if self.num_speculative_tokens_per_batch_size is not None:
            d["num_speculative_tokens_per_batch_size"] = [
                list(r) for r in self.num_speculative_tokens_per_batch_size]
        return d

    def describe(self) -> str:
        per = "".join(f", k={k} at {a}-{b} requests"
                      for a, b, k in self.num_speculative_tokens_per_batch_size or ())
        what = {"ngram": f"n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}",
                "suffix": f"tree depth {self.suffix_decoding_max_tree_depth}, "
                          f"{self.suffix_decoding_max_cached_requests} cached requests",
                "draft_model": f"draft model {self.model}, {self.draft_sample_method} drafts",
                "layer_skip": f"the first {self.num_draft_layers} layers draft, "
                              f"{self.draft_sample_method}"}[self.method]
        return (f"speculative decoding: {self.method}, k={self.num_speculative_tokens}{per}, "
                f"{what}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_D = EngineConfig()


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The scheduling flags (shared by ``serve`` and ``sim``): budget, sequences, policy, blocks."""
    p.add_argument("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens,
                   help=f"token budget per engine step (default {_D.max_num_batched_tokens})")
    p.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs,
                   help=f"most requests running at once (default {_D.max_num_seqs})")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context, capped at the KV cache)")
    p.add_argument("--scheduling-policy", default=_D.scheduling_policy,
                   choices=QUEUE_POLICIES + POLICIES, metavar="{fcfs,priority}",
                   help="waiting-queue order: fcfs (default) or priority (the request field "
                        "`priority`, lower first; may preempt lower-priority running requests). "
                        "chunked/naive/static are deprecated spellings of the two flags below")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=_D.enable_chunked_prefill,
                   help="split long prompts into chunks under the token budget (default on; "
                        "--no-enable-chunked-prefill prefills each prompt whole)")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=_D.long_prefill_token_threshold, metavar="N",
                   help="with chunked prefill, at most N of a request's prompt tokens per step "
                        "(default 0: no cap but the token budget)")
    p.add_argument("--enable-prefill-pacing", action=argparse.BooleanOptionalAction,
                   default=_D.enable_prefill_pacing,
                   help="chunked prefill only: while requests decode, long prompts (over 4%% "
                        "of --max-model-len) advance by one shared chunk per step that adds "
                        "about one decode step's time (at least 16 tokens), so the decodes "
                        "beside them are not stalled by their prefill; their own first token "
                        "comes later. The engine prices the chunk from its measured steps, the "
                        "simulator from its cost model (a cost model whose prefill hides under "
                        "the decode, like --preset lecture's, is never paced). With nothing "
                        "decoding, short prompts at the queue's front that fit whole start "
                        "before a long prompt's next chunk, which is then paced. Default on; off "
                        "with --ttft-slo-ms")
    p.add_argument("--static-batching", action="store_true",
                   help="admit a batch only when nothing runs (static batching, for comparison)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                   help="SLO-aware admission: requests whose estimated TTFT exceeds MS are "
                        "rejected at arrival (429) or deferred (--slo-admission defer)")
    p.add_argument("--slo-admission", default=_D.slo_admission, choices=SLO_ADMISSION,
                   help="what --ttft-slo-ms does with a request that cannot meet it")
    p.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="past N waiting requests a new one gets HTTP 429 with Retry-After "
                        "(default: unbounded)")
    p.add_argument("--block-size", type=int, default=_D.block_size, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_D.enable_prefix_caching,
                   help="automatic prefix caching: full blocks named by a chained hash are reused "
                        "by later requests with the same prefix (default on)")
    p.add_argument("--prefix-caching-hash-algo", default=_D.prefix_caching_hash_algo,
                   choices=HASH_ALGOS, help="block hash (the same in every process and restart)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")


def batching_from_args(a: argparse.Namespace) -> str:
    """The batching mode (chunked / naive / static) the scheduling flags ask for, the deprecated
    ``--scheduling-policy chunked|naive|static`` included (with its notice)."""
    return EngineConfig(scheduling_policy=a.scheduling_policy,
                        enable_chunked_prefill=a.enable_chunked_prefill,
                        static_batching=a.static_batching).batching


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Engine flags, spelled as vLLM spells them where vLLM has one."""
    if positional_model:
        p.add_argument("model", nargs="?", default=None,
                       help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=_D.dtype, choices=DTYPE_CHOICES,
                   help="auto: bfloat16 where this CPU's bf16 matmul is native, else float32 "
                        "(the choice is logged at start)")
    p.add_argument("--kv-cache-dtype", default=_D.kv_cache_dtype, choices=KV_CACHE_DTYPE_CHOICES,
                   help="dtype of the paged KV cache (auto: the model's dtype; int8: 8-bit codes "
                        "and a scale per head and token, half bf16's bytes)")
    p.add_argument("--load-format", default=_D.load_format, choices=LOAD_FORMAT_CHOICES)
    p.add_argument("--quantization", default=_D.quantization, choices=QUANTIZATION_CHOICES,
                   help="auto: a GGUF's weights as stored (Q4_1, Q8_0, K-quants ...), dense for "
                        "HF folders; none: dense in --dtype; int8/int4: requantize every linear "
                        "weight (per group of 32)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="every step on the plain torch path (no fused quantized kernels)")
    p.add_argument("--kv-cache-memory", type=float, default=_D.kv_cache_memory,
                   help="GiB of KV cache (ignored with --num-kv-blocks)")
    add_scheduler_args(p)
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--attention-backend", default=_D.attention_backend,
                   choices=ATTENTION_BACKEND_CHOICES,
                   help="auto (the fastest that runs here) or a backend name")
    p.add_argument("--num-threads", type=int, default=None,
                   help="compute threads of the engine core, fixed (default: the CPUs it may "
                        "use, affinity mask and cgroup quota, fewer while other processes hold "
                        "them)")
    p.add_argument("--max-logprobs", type=int, default=_D.max_logprobs,
                   help=f"most logprobs / top_logprobs / prompt_logprobs per request "
                        f"(default {_D.max_logprobs})")
    p.add_argument("--logprobs-mode", default=_D.logprobs_mode, choices=LOGPROBS_MODES,
                   help="raw_logprobs (default): the model's log-softmax; processed_*: after "
                        "temperature / top-k / top-p; *_logits: the logits themselves")
    p.add_argument("--structured-outputs-compile-timeout", type=float,
                   default=_D.structured_outputs_compile_timeout, metavar="S",
                   help="most CPU seconds a structured-output grammar (response_format, "
                        "structured_outputs) may take to compile. Grammars compile in "
                        "separate worker processes at the lowest CPU priority, so the steps "
                        "of running requests keep the cores; a compile over S is killed and "
                        "its requests fail with HTTP 400 naming this flag (later requests "
                        "with the same spec too), the server serves on. CPU time, not wall "
                        "time: a busy server slows the compile, it does not fail it. A "
                        "compile nobody waits for any more (its clients disconnected) is "
                        f"killed at once (default {_D.structured_outputs_compile_timeout:g}; "
                        "0: no limit)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=_D.batch_invariant,
                   help="a request's tokens, logprobs and text do not depend on its batch-mates, "
                        "n, chunking, prefix-cache hits or the thread count (default off: "
                        "prefills are slower with it, see README Numerics); needs the CPU "
                        "kernels and quantized weights or dense bf16 weights on AMX")

    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4} (drafts from '
                        'earlier occurrences of the latest n-gram, verified in the step; '
                        'greedy output unchanged); methods ngram, suffix, draft_model ("model": '
                        'PATH), layer_skip ("num_draft_layers": N), each with '
                        'num_speculative_tokens (suffix: default 24); see docs/engine.md')

    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation, vLLM\'s JSON: {"kv_role": '
                        '"kv_producer"|"kv_consumer"|"kv_both", "kv_port": 14579, '
                        '"kv_connector_extra_config": {"mode": "pull"|"push", "granularity": '
                        '"layerwise"|"eager", "incremental": true, "transport": "tcp"|"shm", '
                        '"timeout_s": 120, "max_bandwidth": "1gbit"}}; requests then take '
                        'kv_transfer_params (see docs/disaggregation.md)')

    p.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                   default=_D.distributed_executor_backend,
                   help="where the worker (model, KV cache, KV connector) runs: in the engine "
                        "core's process (uni, default) or in a Ray actor (ray; restarted by Ray "
                        "if it dies)")
    p.add_argument("--ray-address", default=None,
                   help="with --distributed-executor-backend ray: the Ray cluster to join "
                        "(default: a local one, or RAY_ADDRESS)")
    p.add_argument("--ray-node-ip", default=None,
                   help="with --distributed-executor-backend ray: the node to put the worker on")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish prefix-cache block events over ZeroMQ for a prefix-aware '
                        'router, vLLM\'s JSON: {"enable_kv_cache_events": true, "endpoint": '
                        '"tcp://*:5557"} (docs/router.md)')


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags (the positional MODEL or --model)."""
    names = {f.name for f in fields(EngineConfig)}
    kw = {k: v for k, v in vars(a).items() if k in names}
    kw["model"] = getattr(a, "model_flag", None) or getattr(a, "model", None)
    if kw.get("load_format") == "hf":
        kw["load_format"] = "safetensors"
    return EngineConfig(**kw)


# ------------------------------------------------------------------ KV transfer
# ``--kv-transfer-config``: vLLM's JSON (``KVTransferConfig``), checked once (plain data).
#
# * ``kv_role``: ``kv_producer`` (a prefill instance), ``kv_consumer`` (a decode instance) or
#   ``kv_both`` (either, per request: what its ``kv_transfer_params`` say).
# * ``kv_connector``: the connector class; ours, ``SloserveConnector`` (the default).
# * ``engine_id``: this instance's name in ``kv_transfer_params`` (default ``kv_ip:kv_port``).
# * ``kv_ip``, ``kv_port``: where this instance's connector listens for the other side's
#   connections (default 127.0.0.1:14579; port 0: any free port, the start-up line says which).
# * ``kv_load_failure_policy``: a decode instance's request whose KV does not arrive (the link
#   failed, the prefill instance died, ``timeout_s`` passed) ``fail``s, or is prefilled here
#   (``recompute``, the default, as vLLM).
# * ``kv_connector_extra_config``: ``mode`` ``pull`` (default: the decode side connects to the
#   prefill side and asks; the serial flow needs it) or ``push`` (the prefill side connects to
#   the decode side named in its request); ``granularity`` ``layerwise`` (default: each layer's
#   KV goes while later layers compute) or ``eager`` (all of it after the prefill's last step);
#   ``incremental`` (default true: the decode side asks only for the blocks its prefix cache
#   lacks; false: every block of the prompt); ``transport`` ``tcp`` (default) or ``shm`` (the KV
#   through a POSIX shared-memory segment per transfer, headers still over TCP; only where both
#   instances are on one host and see one /dev/shm, else that transfer goes over TCP, warned);
#   ``timeout_s`` (default 120: most seconds a transfer may take from the request's admission,
#   and a prefill instance holds a finished request's blocks for a reader); ``max_bandwidth``
#   (bytes/s or ``0.4gbit``-style; default: unthrottled): the sender's token bucket (TCP
#   only: shared memory is no link).

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("SloserveConnector",)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_TRANSFER_MODES = ("pull", "push")
KV_TRANSFER_GRANULARITIES = ("layerwise", "eager")
KV_TRANSPORTS = ("tcp", "shm")
DEFAULT_KV_PORT = 14579


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "SloserveConnector"
    engine_id: str = ""
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    kv_load_failure_policy: str = "recompute"
    mode: str = "pull"
    granularity: str = "layerwise"
    incremental: bool = True
    transport: str = "tcp"
    timeout_s: float = 120.0
    #: bytes/s the sender may put on the link (None: unthrottled)
    max_bandwidth: float | None = None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def describe(self, engine_id: str, host: str, port: int) -> str:
        """The start-up line: the settings and where the connector listens (``host:port``,
        the port it got where 0 was asked)."""
        bw = f", at most {self.max_bandwidth * 8 / 1e9:g} Gbit/s" if self.max_bandwidth else ""
        return (f"KV connector {self.kv_connector} ({self.kv_role}, engine {engine_id}, "
                f"{self.mode} {self.granularity}{', incremental' if self.incremental else ''}, "
                f"{self.transport} on {host}:{port}{bw}, timeout {self.timeout_s:g} s, "
                f"load failures {self.kv_load_failure_policy})")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """From the JSON text, a dict or an instance (None stays None). Raises ValueError
        naming the key, its value and what is allowed."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        extra = value.pop("kv_connector_extra_config", None)
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config must be an "
                             f"object, got {extra!r}")
        top = {"kv_role", "kv_connector", "engine_id", "kv_ip", "kv_port",
               "kv_load_failure_policy"}
        inner = {"mode", "granularity", "incremental", "transport", "timeout_s",
                 "max_bandwidth"}
        unknown = sorted(set(value) - top)
        unknown += sorted(f"kv_connector_extra_config.{k}" for k in set(extra) - inner)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(top))}, kv_connector_extra_config: "
                             f"{', '.join(sorted(inner))})")
        kw = {**value, **extra}
        for name, choices in (("kv_role", KV_ROLES), ("kv_connector", KV_CONNECTORS),
                              ("kv_load_failure_policy", KV_LOAD_FAILURE_POLICIES),
                              ("mode", KV_TRANSFER_MODES),
                              ("granularity", KV_TRANSFER_GRANULARITIES),
                              ("transport", KV_TRANSPORTS)):
            if name == "kv_role" and name not in kw:
                raise ValueError(f"kv_transfer_config: kv_role is required (one of "
                                 f"{', '.join(KV_ROLES)})")
            if name in kw and kw[name] not in choices:
                raise ValueError(f"kv_transfer_config: {name} must be one of "
                                 f"{', '.join(choices)}, got {kw[name]!r}")
        port = kw.get("kv_port", DEFAULT_KV_PORT)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in 0-65535, got "
                             f"{port!r}")
        if not isinstance(kw.get("incremental", True), bool):
            raise ValueError(f"kv_transfer_config: incremental must be true or false, got "
                             f"{kw['incremental']!r}")
        t = kw.get("timeout_s", cls.timeout_s)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
            raise ValueError(f"kv_transfer_config: timeout_s must be a number of seconds in "
                             f"(0, 86400], got {t!r}")
        kw["timeout_s"] = float(t)
        if kw.get("max_bandwidth") is not None:
            try:
                kw["max_bandwidth"] = parse_bandwidth(kw["max_bandwidth"])
            except ValueError as e:
                raise ValueError(f"kv_transfer_config: max_bandwidth: {e}") from None
            if kw["max_bandwidth"] < 1000:
                raise ValueError(f"kv_transfer_config: max_bandwidth must be at least 1000 "
                                 f"bytes/s, got {kw['max_bandwidth']:g}")
        for name in ("engine_id", "kv_ip"):
            if name in kw and not isinstance(kw[name], str):
                raise ValueError(f"kv_transfer_config: {name} must be a string, got "
                                 f"{kw[name]!r}")
        if not kw.get("kv_ip", cls.kv_ip):
            raise ValueError("kv_transfer_config: kv_ip must be an address to listen on "
                             "(0.0.0.0: every interface), got ''")
        return cls(**kw)
