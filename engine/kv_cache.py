"""The paged KV cache tensors: per layer a K and a V tensor [num_blocks, block_size, kv_heads, head_dim].

All layers share one allocation so the cache is a single contiguous region (cheap to size, to pin
and to hand to other libraries); each layer gets views into it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .config import ModelConfig

_ALIGN = 64  # bytes: a cache line, and the widest vector load the CPU kernels issue


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages cost nothing until written.

    ``torch.zeros`` on the host writes every byte: a 1 GiB cache took 0.4 s and 0.7 CPU-seconds at each
    engine start and stayed resident whole, though a CLI call fills a few MB of it. NumPy's zeros come
    from calloc, whose large blocks are fresh anonymous mappings the kernel zero-fills page by page on
    first touch, so start-up is instant and resident memory follows the KV actually written. Zeros, not
    garbage, because attention reads whole blocks and a NaN in an unwritten slot would survive a zero
    weight. On a GPU ``torch.zeros`` is one memset kernel and stays.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = zeroed(
            (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim), dtype, device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers)
        ]

    @staticmethod
    def blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        per_block = config.kv_bytes_per_token(dtype) * block_size
        return max(1, budget_bytes // per_block)

    def gather(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's first ``num_tokens`` tokens: [layers, tokens, kv_heads, head_dim]."""
        n_blocks = -(-num_tokens // self.block_size)
        idx = torch.tensor(block_table[:n_blocks], device=self.storage.device)
        kv = self.storage[:, :, idx].flatten(2, 3)[:, :, :num_tokens]
        return kv[:, 0], kv[:, 1]
