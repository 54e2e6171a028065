"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from sloserve.model.invariant import one_thread
from sloserve.sampling_params import SamplingParams


#: what a uniform is for (:func:`uniform`'s ``stream``): sampling a token, a draft's
#: acceptance test, drawing a probabilistic draft
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2
_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Steele et al. 2014): a bijection of 64-bit ints whose output
    bits each depend on every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, index: int, stream: int = STREAM_SAMPLE) -> float:
    """A float64 uniform in [0, 1) that depends only on (``seed``, ``index``, ``stream``): the
    random number of the token at ``index`` of a request's sequence (prompt and output)
    counted from 0, for one purpose. Counter-based (a hash, not a running stream), so a
    request's draws do not depend on how many it drew before: on its step shapes, its draft
    tokens, their acceptance or its batch-mates."""
    z = _mix64((_mix64(seed & _M64) + ((index << 2) | stream) * 0xD1B54A32D192ED03) & _M64)
    return (z >> 11) * (1.0 / (1 << 53))


class Sampler:
    """Picks one token per row of logits.

    Randomness: the token at index t of a request's sequence (prompt and output, from 0) is
    drawn with one float64 uniform that depends only on the request's seed and t
    (:func:`uniform`); a request without a ``seed`` gets one from the engine's RNG
    (``--seed``) when it first samples, so an unseeded request's stream depends on the order in
    which requests reach their first sample (as in vLLM: pass a seed for reproducible samples).
    The server gives choice i of a seeded request with ``n`` > 1 the seed ``seed + i``
    (``sampling_params.child_seed``, vLLM's rule), so choice 0 draws what the request alone
    would. No request's draws depend on another's. Speculative decoding keys its draws the
    same way (a draft's acceptance test and a probabilistic draft have their own streams), so
    a seeded request with deterministic drafts (n-gram, suffix, greedy draft models) samples
    the tokens it would sample without drafts wherever its logits are the same, whatever k
    and whatever was accepted. (Called without token indices, e.g. by tests, each request's
    draws count up from its first.)

    What holds about batch-mates:

    * Without ``--batch-invariant`` (the default): only the draws above. The logits a
      request samples from depend on its batch-mates (the step's token count picks the linear
      kernels and the dtype between them, chunking and prefix-cache hits pick the attention
      kernel), and the sampling math runs on all rows at once (torch's vectorized loops and
      their scalar tails, split over threads by the step's size). So neither a greedy nor a
      seeded request is guaranteed the same tokens alone and batched, in bfloat16 or float32.
    * With ``batch_invariant`` (``--batch-invariant``): the logits of a row do not depend on
      the step (``sloserve.model.invariant``), and the sampled rows are processed one at a
      time on one torch thread, so a greedy or seeded request's tokens and logprobs are the
      same alone, beside any batch-mates, as any choice of ``n`` with its seed, under any
      chunking, prefix-cache hit, thread count or (deterministic) speculative drafts.
    """

    def __init__(self, seed: int = 0, batch_invariant: bool = False):
        self._rng = torch.Generator().manual_seed(seed)
        self._seeds: dict[str, int] = {}
        self._count: dict[str, int] = {}
        #: sample the non-greedy rows one at a time on one thread (see the class docstring)
        self.batch_invariant = batch_invariant

    def seed_of(self, request_id: str, sp: SamplingParams) -> int:
        """The request's seed (an unseeded request's is drawn at its first use)."""
        s = self._seeds.get(request_id)
        if s is None:
            s = sp.seed if sp.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._rng))
            self._seeds[request_id] = s
        return s

    def release(self, request_id: str) -> None:
        """Forget a finished request's seed."""
        self._seeds.pop(request_id, None)
        self._count.pop(request_id, None)

    def uniforms(self, request_ids: list[str], params: list[SamplingParams],
                 indices: list[int] | None, stream: int = STREAM_SAMPLE) -> torch.Tensor:
        """[R] float64: :func:`uniform` of each request's seed and token index (None: each
        request's next draw count)."""
        if indices is None:
            indices = []
            for rid in request_ids:
                n = self._count.get(rid, 0)
                self._count[rid] = n + 1
                indices.append(n)
        return torch.tensor([uniform(self.seed_of(rid, sp), i, stream)
                             for rid, sp, i in zip(request_ids, params, indices)],
                            dtype=torch.float64)

    def __call__(self, logits: torch.Tensor, request_ids: list[str],
                 params: list[SamplingParams], indices: list[int] | None = None) -> list[int]:
        """Sample.

        Greedy rows take the argmax; the other rows are sampled together (:func:`draw`), each
        with its uniform (with ``batch_invariant``: one row at a time on one thread). A row
        that cannot be sampled (:data:`UNSAMPLEABLE`: a NaN logit, or every token at -inf)
        gets -1, and only it: the runner fails that request alone.

        Args:
            logits: [S, V] float32.
            request_ids, params: one per row.
            indices: per row, the index of the token it samples in its request's sequence
                (None: each request's draws count up, see the class docstring).

        Returns:
            S token ids.
        """
        out = [0] * len(params)
        greedy = [i for i, sp in enumerate(params) if sp.greedy]
        rows = [i for i, sp in enumerate(params) if not sp.greedy]
        if greedy:
            sub = logits if len(greedy) == len(params) else logits[greedy]
            idx = sub.argmax(dim=-1)
            # the row's largest value (a NaN if it holds one) must be finite
            ok = torch.isfinite(sub.gather(-1, idx[:, None])[:, 0]).tolist()
            for i, t, good in zip(greedy, idx.tolist(), ok):
                out[i] = t if good else UNSAMPLEABLE
        if not rows:
            return out
        u = self.uniforms([request_ids[i] for i in rows], [params[i] for i in rows],
                          None if indices is None else [indices[i] for i in rows])
        if self.batch_invariant:
            with one_thread():
                for j, i in enumerate(rows):
                    out[i] = self._draw_rows(logits[i:i + 1], [params[i]], u[j:j + 1])[0]
        else:
            sub = logits if len(rows) == len(params) else logits[rows]
            for i, t in zip(rows, self._draw_rows(sub, [params[i] for i in rows], u)):
                out[i] = t
        return out

    def _draw_rows(self, sub: torch.Tensor, params: list[SamplingParams],
                   u: torch.Tensor) -> list[int]:
        """Sample every row of ``sub`` [R, V] (the non-greedy rows) with its uniform ``u``
        (:func:`draw`)."""
        # float32 whatever the logits' dtype (fp16 logits / 1e-4 overflowed to inf - inf)
        scaled = self.processed(sub, params)
        top = scaled.amax(dim=-1, keepdim=True)  # (a NaN if the row holds one)
        bad = ~torch.isfinite(top[:, 0])
        if bool(bad.any()):  # nothing to draw from: drawn as uniform, then refused
            scaled[bad] = 0.0
            top[bad] = 0.0
        scaled -= top  # in place: one [S, V] buffer in all
        got = draw(scaled.exp_(), u).tolist()
        return [UNSAMPLEABLE if b else t for t, b in zip(got, bad.tolist())]

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distributions non-greedy rows sample from ([R, V] float32: :meth:`processed`,
        then softmax)."""
        return torch.softmax(self.processed(logits, params), -1)

    @staticmethod
    def processed_logits(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """One row of :meth:`processed` ([V] float32; a greedy request's row unchanged)."""
        return Sampler.processed(row[None], [sp])[0]

    @staticmethod
    def processed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The logits each non-greedy row draws from: scaled by its temperature, tokens outside
        its top-k and top-p at -inf ([R, V] float32, a new tensor; greedy rows unchanged).
        Each row's result depends on that row alone: the rows that need top-k or top-p are
        sorted once, together.

        top-k keeps every token at least as likely as the k-th (ties included); top-p then
        drops a token when the mass of the tokens before it (after top-k) already reaches
        top_p; the most likely token always stays (a top_p that rounds to 0 in float32 must
        not drop every token)."""
        R, V = logits.shape
        # a temperature past float32's range (1e39 is a valid request) would be inf, and a
        # masked token's -inf / inf is NaN: the largest float32 flattens the row just the same
        temps = torch.tensor([1.0 if sp.greedy else min(sp.temperature, _F32_MAX)
                              for sp in params], dtype=torch.float32)
        out = logits.float() / temps[:, None]
        cut = [j for j, sp in enumerate(params)
               if not sp.greedy and (0 < sp.top_k < V or sp.top_p < 1.0)]
        if not cut:
            return out
        rows = out[cut]
        vals, idx = torch.sort(rows, dim=-1, descending=True)
        ks = torch.tensor([params[j].top_k if 0 < params[j].top_k < V else V for j in cut])
        kth = vals.gather(-1, (ks - 1)[:, None])
        vals = vals.masked_fill(vals < kth, float("-inf"))
        top_p = torch.tensor([params[j].top_p for j in cut], dtype=torch.float32)
        probs = torch.softmax(vals, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        vals = vals.masked_fill(drop, float("-inf"))
        out[cut] = torch.full_like(rows, float("-inf")).scatter(-1, idx, vals)
        return out


#: the token the sampler gives a row it cannot sample (a NaN logit, or no token left)
UNSAMPLEABLE = -1
#: the largest temperature the sampler divides by (float32's largest finite value)
_F32_MAX = float(torch.finfo(torch.float32).max)
#: tokens per block of :func:`draw`'s two-level search
DRAW_BLOCK = 256


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse transform sampling: the first token whose cumulative
    probability exceeds ``u`` times the row's total.

    Two levels so that every sum is short (a float32 prefix sum over the whole vocabulary
    misplaces up to ~1e-3 of the mass among unlikely tokens): block sums of
    :data:`DRAW_BLOCK` tokens, their prefix sum in float64, then the prefix sum of the one
    chosen block in float64. A token of probability 0 (top-k / top-p / a grammar's mask) is
    never drawn, even where rounding puts the target at a row's or block's end. ~0.7 ms for
    16 rows of 49,152 (per-row ``torch.multinomial``: ~1.7 ms a row, measured).

    Args:
        probs: [S, V] float32 probabilities, or any positive multiples of them per row (e.g.
            exp(logits - max) before normalising).
        u: [S] float64 in [0, 1).

    Returns:
        [S] int64 token ids.

    Raises:
        ValueError: a row has no token of positive probability, or NaN (NaN logits, or a mask
            that allows nothing).
    """
    S, V = probs.shape
    nb = -(-V // DRAW_BLOCK)
    if nb * DRAW_BLOCK != V:
        probs = torch.nn.functional.pad(probs, (0, nb * DRAW_BLOCK - V))
    blocks = probs.view(S, nb, DRAW_BLOCK)
    sums = blocks.sum(-1)                                         # [S, nb]
    cum = sums.double().cumsum(-1)
    total = cum[:, -1]
    bad = ~(total > 0) | ~torch.isfinite(total)
    if bool(bad.any()):
        raise ValueError(f"cannot sample row {int(bad.nonzero()[0, 0])}: its probabilities sum "
                         f"to {float(total[bad][0])}")
    x = u.double() * total
    b = torch.minimum(_first_above(cum, x), _last_positive(sums))
    rows = torch.arange(S)
    x = x - torch.where(b > 0, cum[rows, (b - 1).clamp(min=0)], 0.0)
    chosen = blocks[rows, b]                                      # [S, DRAW_BLOCK]
    j = torch.minimum(_first_above(chosen.double().cumsum(-1), x), _last_positive(chosen))
    return b * DRAW_BLOCK + j


def _first_above(cum: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose prefix sum ``cum`` [S, n] exceeds ``x`` [S]."""
    return torch.searchsorted(cum, x[:, None], right=True)[:, 0]


def _last_positive(t: torch.Tensor) -> torch.Tensor:
    """Per row of ``t`` [S, n], the last index holding a value > 0 (0 if none)."""
    return torch.where(t > 0, torch.arange(t.shape[-1]), 0).max(-1).values


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """Set the logits of disallowed tokens to -inf in place (structured outputs).

    Args:
        logits: [S, V] float32.
        rows: the rows to constrain; masks: one per row, ceil(V / 32) little-endian int32 words
            as bytes (bit ``t % 32`` of word ``t // 32`` set: token t allowed; tokens past the
            mask's end are disallowed).
    """
    if not rows:
        return
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(len(rows), -1)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1   # [R, W, 32]
    allowed = bits.view(len(rows), -1).bool()
    v = logits.shape[1]
    if allowed.shape[1] < v:
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
    idx = torch.tensor(rows, dtype=torch.long)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :v], float("-inf"))
