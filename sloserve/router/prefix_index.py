"""What each replica's prefix cache holds, as its KV cache events tell it.

Per worker: the set of block hashes it holds (``BlockStored`` adds, ``BlockRemoved`` removes,
``AllBlocksCleared`` empties; hashes in their event form, see ``sloserve.engine.kv_events``),
the block size its events name, and *pending* hashes: the blocks of prompts just routed to it,
counted as held for ``speculative_ttl`` seconds (until its own events can have said so), so
that a burst of requests with one new prefix is not spread over every replica.

A prompt's match on a worker is the number of its leading blocks the worker holds: the engine
reuses cached blocks up to the first miss (``KVCacheManager.get_computed_blocks``).
"""
from __future__ import annotations

import time
from typing import Iterable

from sloserve.engine.block_hash import extend_block_hashes
from sloserve.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                       KVEventBatch, external_block_hash, normalize_block_hash)


def prompt_block_hashes(token_ids: list[int], block_size: int,
                        salt: str | None = None) -> list[int]:
    """The event-form hashes of the full blocks of a prompt, as the engine computes them."""
    return [external_block_hash(h)
            for h in extend_block_hashes([], token_ids, block_size, salt)]


class PrefixIndex:
    """Block hashes held per worker (keyed by its URL)."""

    def __init__(self, speculative_ttl: float = 0.0, clock=time.monotonic):
        self.speculative_ttl = speculative_ttl
        self.clock = clock
        self._blocks: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}
        self._pending: dict[str, dict[int, float]] = {}
        #: batches applied per worker (for tests and /health)
        self.num_batches: dict[str, int] = {}

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        """Apply one batch of ``worker``'s events, in order."""
        held = self._blocks.setdefault(worker, set())
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held.update(normalize_block_hash(h) for h in ev.block_hashes)
                self._block_size[worker] = ev.block_size
                pending = self._pending.get(worker)
                if pending:
                    for h in ev.block_hashes:
                        pending.pop(normalize_block_hash(h), None)
            elif isinstance(ev, BlockRemoved):
                held.difference_update(normalize_block_hash(h) for h in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
                self._pending.pop(worker, None)
        self.num_batches[worker] = self.num_batches.get(worker, 0) + 1

    def clear(self, worker: str) -> None:
        """Forget what ``worker`` held (it went down: a restarted engine starts empty)."""
        self._blocks.pop(worker, None)
        self._pending.pop(worker, None)

    def num_blocks(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def block_size(self, worker: str, default: int) -> int:
        """The block size ``worker``'s events name (``default`` before its first event)."""
        return self._block_size.get(worker, default)

    def holds_any(self, workers: Iterable[str]) -> bool:
        """Whether any of ``workers`` holds (or has pending) any block."""
        return any(self._blocks.get(w) or self._pending.get(w) for w in workers)

    def match(self, worker: str, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` ``worker`` holds (pending ones included)."""
        held = self._blocks.get(worker, set())
        pending = self._pending.get(worker)
        now = self.clock() if pending else 0.0
        n = 0
        for h in hashes:
            if h in held:
                n += 1
                continue
            if pending:
                t = pending.get(h)
                if t is not None and t > now:
                    n += 1
                    continue
            break
        return n

    def add_pending(self, worker: str, hashes: list[int]) -> None:
        """Count ``hashes`` as held by ``worker`` for ``speculative_ttl`` seconds."""
        if self.speculative_ttl <= 0 or not hashes:
            return
        now = self.clock()
        pending = self._pending.setdefault(worker, {})
        if len(pending) > 4 * len(hashes) + 1024:  # drop the expired ones now and then
            for h in [h for h, t in pending.items() if t <= now]:
                del pending[h]
        until = now + self.speculative_ttl
        held = self._blocks.get(worker, ())
        for h in hashes:
            if h not in held:
                pending[h] = until
