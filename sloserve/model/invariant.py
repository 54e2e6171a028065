"""``--batch-invariant``: what each op of a step does so that a row's result is a function of
that row's own inputs (its token, its position, its request's earlier K/V), never of the other
rows of the step, their number, how the prompt was chunked, what the prefix cache held, or the
thread count. vLLM's ``VLLM_BATCH_INVARIANT`` and SGLang's deterministic mode aim at the same.

Where the default path depends on the batch, and what the mode does instead:

* Linear layers (:mod:`sloserve.model.model_loader`): by default a step's token count picks
  the quantized product, the AMX GEMM or oneDNN at crossovers measured at start-up, and those
  sum in different orders (bf16 vs int8 activations, another blocking). In the mode one method
  serves every row count: the quantized weights' kernel where the model is quantized (the x16
  product, or the row-layout one), else the AMX bf16 GEMM. Both are row-invariant: activations
  are quantized per row and per group of 32 (each row's scale from that row only), and each
  output is one accumulator summed over the groups (the K blocks) in order, whatever the
  number of rows in the tile or the work split over the threads (csrc/qlinear_x16.h,
  csrc/qlinear_rows.h, csrc/amx_gemm.h). Dense weights the kernels cannot serve so (float32,
  or bf16 without AMX: oneDNN's blocking depends on the row count) are refused at start.
* Norms, SiLU-and-mul, RoPE, the embedding: per row already (csrc/elementwise.h); the RoPE
  cos/sin come from a table computed once per position (:class:`RopeTableCache`), not per step
  (torch's vectorized cos and its scalar tail round differently, and which elements fall in the
  tail depends on the step's size and thread split).
* Attention (:mod:`sloserve.model.attention.cpu_paged`): each position is always computed by
  the same kernel, one whose result for a query row depends on that row alone. Prompt
  positions (below the request's prompt length, which the scheduler passes down): the flash
  attention kernel's invariant variant, whose query lanes never touch each other (by default
  a tile's 16 queries share the decision to move the softmax reference, so a token's result
  depends on which chunk it came in); also for a one-token chunk and for the last prompt token
  recomputed after a full prefix-cache hit. Generated positions (decodes, and tokens recomputed
  after a preemption): the paged decode kernel, each row as a request of its own, its splits at
  fixed multiples of ``SPLIT_LEN`` positions merged in order (never by thread count). So no
  position ever needs the two kernels to agree. Where the flash kernel does not run (float32,
  no AMX / AVX512-BF16) every row takes the decode kernel that way.
* Sampling and logprobs (:mod:`sloserve.model.sampler`, :mod:`sloserve.model.runner`): row by
  row on one torch thread (:func:`one_thread`), so that torch's elementwise and reduction
  loops see the same element layout whatever the step.

What it costs: decode steps and prompts run the kernels they run without the mode (the
invariant flash variant adds a mask per diagonal block); the difference is in the linear
layers of large steps, which keep the quantized product where the default would have switched
to the AMX GEMM above its measured crossover, and, where the flash kernel does not run, prompt
attention on the decode kernel. README "Numerics" gives the measured figures.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

#: a crossover above any step's token count: one method serves every step
ALL_ROWS = 1 << 62


@contextmanager
def one_thread():
    """Run torch ops on one intra-op thread inside the block (restored after): an elementwise
    op or reduction split over threads cuts its range at thread-count-dependent points, and
    the pieces' vectorized bodies and scalar tails round differently."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class RopeTableCache:
    """RoPE cos / sin [positions, D / 2] float32, each position computed once (in chunks of
    :attr:`CHUNK` positions on one thread) and looked up by index after, so that a position's
    values never depend on the step it comes in.

    Args:
        inv_freq: [D / 2] float32 inverse frequencies.
    """

    CHUNK = 4096

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.float().contiguous()
        half = self.inv_freq.shape[0]
        self.cos = torch.empty(0, half)
        self.sin = torch.empty(0, half)

    def _grow(self, n: int) -> None:
        have = self.cos.shape[0]
        cos, sin = [self.cos], [self.sin]
        with one_thread():
            for p0 in range(have, n, self.CHUNK):
                pos = torch.arange(p0, p0 + self.CHUNK, dtype=torch.float32)
                ang = pos[:, None] * self.inv_freq[None, :]
                cos.append(ang.cos())
                sin.append(ang.sin())
        self.cos, self.sin = torch.cat(cos).contiguous(), torch.cat(sin).contiguous()

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D / 2] float32 contiguous of ``positions`` [T] int64."""
        if positions.numel():
            n = int(positions.max()) + 1
            if n > self.cos.shape[0]:
                self._grow(n)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
