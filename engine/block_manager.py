"""Allocation of paged-KV-cache blocks: a free list and reference counts.

Reference counts let several sequences point at one block (shared prefixes, forks); a block goes
back to the free list when its last user lets go.
"""

from __future__ import annotations

from collections import deque

from .errors import RequestError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """New blocks a table needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to ``block_table`` (in place) until it holds ``num_tokens`` tokens."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > self.num_free:
            raise RequestError(f"KV cache full: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block = self.free_ids.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)

    def share(self, block_ids: list[int]) -> list[int]:
        """Add a user to each block (for a sequence that reuses them) and return them."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1
        return list(block_ids)

    def release(self, block_table: list[int]) -> None:
        """Drop one user of each block; blocks nobody uses return to the free list."""
        for b in reversed(block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
            elif self.ref_counts[b] < 0:
                raise ValueError(f"block {b} released more often than taken")
        block_table.clear()
