"""The chained hash of full KV blocks: one definition for the engine's prefix cache and for the
routing chain producers compute (``prefix_chain``). Pure ``hashlib``: no torch.

Block ``i`` of a token sequence (tokens ``i*B .. (i+1)*B - 1`` for block size ``B``) hashes to
``H(hash of block i-1 || its token ids as int64)`` (BLAKE2b, 16 bytes), so equal hashes mean
equal tokens from position 0 through the end of the block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: it identifies the block's tokens *and* everything before."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Append to ``hashes`` the chained hash of every full block of ``token_ids`` not hashed yet."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
