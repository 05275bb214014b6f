"""How big the paged KV pool is when the user gave no size: a full batch, capped by free memory.

Issue 31: the old default (256 MiB, 5,824 SmolLM2 tokens in float32) held fewer tokens than 32
typical chats need, so a worker at its default ``max_num_seqs`` preempted itself. The default is
now stated in tokens (``max_num_seqs x kv_tokens_per_seq``, the engine's config), bounded so that
a large batch on a small machine does not take the memory the weights need.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# When neither KV blocks nor bytes are given the pool holds ``default_kv_tokens`` tokens (the
# engine asks for max_num_seqs x kv_tokens_per_seq), but at most this share of the memory free on
# the device at load: the weights and the activations need the rest.
DEFAULT_KV_TOKENS = 32 * 512
KV_FREE_MEMORY_SHARE = 0.5


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on ``device`` now: CUDA's free memory, on a CPU Linux's
    ``MemAvailable``; None where it cannot be told."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_kv_blocks(
    per_block_bytes: int, block_size: int, wanted_tokens: int, free_bytes: int | None
) -> int:
    """Blocks of the default KV pool: enough for ``wanted_tokens``, capped at
    ``KV_FREE_MEMORY_SHARE`` of ``free_bytes`` (when known), and at least one block."""
    blocks = -(-wanted_tokens // block_size)
    if free_bytes is not None:
        blocks = min(blocks, int(free_bytes * KV_FREE_MEMORY_SHARE) // per_block_bytes)
    return max(blocks, 1)


def kv_pool_blocks(
    per_block_bytes: int,
    block_size: int,
    kv_memory_bytes: int | None,
    default_kv_tokens: int,
    device: torch.device,
) -> int:
    """Blocks of the pool: ``kv_memory_bytes`` worth when given, else the default (warned about
    when free memory caps it below ``default_kv_tokens``)."""
    if kv_memory_bytes is not None:
        return kv_memory_bytes // per_block_bytes
    free = free_memory_bytes(device)
    blocks = default_kv_blocks(per_block_bytes, block_size, default_kv_tokens, free)
    if blocks * block_size < default_kv_tokens:
        log.warning(
            "the default KV cache of %d tokens would take more than %d%% of the %.2f GiB free: "
            "it holds %d tokens; give its size with --kv-memory or --kv-blocks",
            default_kv_tokens,
            KV_FREE_MEMORY_SHARE * 100,
            (free or 0) / 2**30,
            blocks * block_size,
        )
    return blocks
