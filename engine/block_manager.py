"""Allocation of paged-KV-cache blocks: a free list and reference counts.

Reference counts let several sequences point at one block (shared prefixes, forks); a block goes
back to the free list when its last user lets go.

A block cache (the prefix tree, ``prefix_tree.py``) may keep finished blocks for later requests: it
holds one reference of its own on each block it caches. A cached block that only the cache holds is
*reclaimable*: it counts as free for allocation, and ``grow`` asks the cache to evict such blocks
when the free list runs short.

The free list is a stack: the block given back last is taken first, so the same few blocks serve one
request after another. Taken in turn from a queue, every block of the cache was written within a few
requests: on the host, whose cache pages are mapped on first write (``kv_cache.zeroed``), each request
wrote fresh pages, and a first write here cost 7-113 ms per 2.4 MB (one layer's K of a 3K-token prompt,
default model): a third of a fused pass's 4 s went to the 3K-row KV writes, and the whole cache became
resident. Order is no safeguard for copies still reading a block: those are queued on the stream that
gives the block back (``swap.py``).
"""

from __future__ import annotations

from typing import Protocol

from .errors import CacheFullError


class BlockCache(Protocol):
    """What the block manager needs from a cache of blocks: told when one of its blocks loses its
    last outside user, and asked to give back ``n`` of those blocks."""

    def on_unused(self, block: int) -> None: ...

    def evict(self, n: int) -> None: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 on top
        self.cached = [False] * num_blocks  # held by the cache (one of its references is the cache's)
        self.num_reclaimable = 0  # cached blocks that only the cache holds
        self.cache: BlockCache | None = None

    @property
    def num_free(self) -> int:
        """Blocks a ``grow`` can take now: the free list plus cached blocks nobody uses."""
        return len(self.free_ids) + self.num_reclaimable

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """New blocks a table needs to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to ``block_table`` (in place) until it holds ``num_tokens`` tokens."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > self.num_free:
            raise CacheFullError(f"KV cache full: need {need} blocks, {self.num_free} free")
        if need > len(self.free_ids):
            assert self.cache is not None  # reclaimable blocks exist only with a cache
            self.cache.evict(need - len(self.free_ids))
        for _ in range(need):
            block = self.free_ids.pop()
            self.ref_counts[block] = 1
            block_table.append(block)

    def share(self, block_ids: list[int]) -> list[int]:
        """Add a user to each block (for a sequence that reuses them) and return them."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            if self.cached[b] and self.ref_counts[b] == 1:
                self.num_reclaimable -= 1
            self.ref_counts[b] += 1
        return list(block_ids)

    def release(self, block_table: list[int]) -> None:
        """Drop one user of each block; blocks nobody uses return to the free list (last first, so
        the next table takes them in the same order)."""
        for b in reversed(block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
            elif self.ref_counts[b] < 0:
                raise ValueError(f"block {b} released more often than taken")
            elif self.ref_counts[b] == 1 and self.cached[b]:
                self.num_reclaimable += 1
                assert self.cache is not None
                self.cache.on_unused(b)
        block_table.clear()

    def cache_block(self, block: int) -> None:
        """The cache takes its own reference on a block a sequence holds."""
        if self.ref_counts[block] <= 0 or self.cached[block]:
            raise ValueError(f"block {block} is free or already cached")
        self.cached[block] = True
        self.ref_counts[block] += 1

    def uncache_block(self, block: int) -> None:
        """The cache drops a block nobody else uses: it returns to the free list."""
        if not self.cached[block] or self.ref_counts[block] != 1:
            raise ValueError(f"block {block} is not an unused cached block")
        self.cached[block] = False
        self.num_reclaimable -= 1
        self.ref_counts[block] = 0
        self.free_ids.append(block)
