"""The paged KV cache tensors: per layer a K and a V tensor [num_blocks, block_size, kv_heads, head_dim].

All layers share one allocation so the cache is a single contiguous region (cheap to size, to pin
and to hand to other libraries); each layer gets views into it.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
            dtype=dtype, device=device,
        )
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
