"""Block hashes for automatic prefix caching (vLLM V1's design).

A *full* block of ``block_size`` tokens is named by a hash chained over its parent's hash, its
token ids and its extra keys::

    h_0 = H(b"" || salt || tokens[0:bs])          (salt: the request's cache_salt, first block)
    h_i = H(h_{i-1} || tokens[i*bs:(i+1)*bs])

so equal hashes mean equal prefixes (up to a collision of the hash), and requests with different
salts never share a block. ``H`` is SHA-256 over a fixed byte encoding (little-endian int64 token
ids, UTF-8 salt with its length), so a hash is the same in every process and after a restart
(vLLM's ``--prefix-caching-hash-algo sha256``; Python's ``hash()`` is salted per process) and a
router or KV connector can compare hashes between processes.

Plain Python, no torch.
"""
from __future__ import annotations

import hashlib
import struct

BlockHash = bytes  # 32 bytes


def hash_block(parent: BlockHash | None, token_ids, salt: str | None = None) -> BlockHash:
    """The hash of one full block (see the module docstring).

    Args:
        parent: the previous block's hash, None for the first block.
        token_ids: the block's token ids (exactly block_size of them).
        salt: extra key of the first block (``cache_salt``); ignored for later blocks (the chain
            carries it).
    """
    h = hashlib.sha256()
    if parent is None:
        s = (salt or "").encode()
        h.update(b"\x00" + struct.pack("<q", len(s) if salt is not None else -1) + s)
    else:
        h.update(b"\x01" + parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids, block_size: int,
                        salt: str | None = None) -> list[BlockHash]:
    """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it lacks; returns it.

    ``token_ids`` is a request's whole sequence (prompt + output so far); ``hashes`` holds the
    hashes of its first blocks (computed earlier), so each block is hashed once.
    """
    n_full = len(token_ids) // block_size
    for i in range(len(hashes), n_full):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 token_ids[i * block_size:(i + 1) * block_size], salt))
    return hashes
