"""Reading and writing single tokens of vLLM's paged KV cache, whatever the backend's block layout.

vLLM's CPU attention backend does not store a block as ``[tokens, heads, dim]``: its K half is
packed per ISA (on AVX2 "vec" it is dim-major, on AMX it is tiled), and the layout is an
implementation detail that changes between releases. Rather than hard-code it, the connector asks
the backend itself: it writes coordinate-coded K and V through the backend's own
``do_kv_cache_update`` into a scratch cache of two blocks and reads back where every (token, head,
dim) landed. The resulting index maps then gather (save) and scatter (load) exactly what the kernel
reads, and a layout the probe cannot explain is refused instead of silently corrupting attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (key, value, cache, slot_mapping) -> None: the backend's own write of new tokens into a cache.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class UnsupportedLayoutError(RuntimeError):
    """The paged cache is not block-major with one token per (head, dim) slot; we cannot address it."""


class PagedLayout:
    """Per-block index maps: ``k_index[t, h, d]`` / ``v_index[t, h, d]`` = offset inside one flattened block."""

    def __init__(self, k_index: torch.Tensor, v_index: torch.Tensor) -> None:
        self.k_index = k_index
        self.v_index = v_index
        self.block_size, self.num_kv_heads, self.head_dim = k_index.shape

    @classmethod
    def probe(cls, write: CacheWriter, block_shape: tuple[int, ...], dtype: torch.dtype, block_size: int,
              num_kv_heads: int, head_dim: int) -> PagedLayout:
        """Learn the layout by writing coordinates through ``write`` into a two-block scratch cache.

        Block 1 is written (slots ``block_size .. 2*block_size-1``); block 0 must stay untouched,
        which proves the first cache dimension is the block index.
        """
        if block_size > 256 or head_dim > 256 or num_kv_heads > 256:
            raise UnsupportedLayoutError("coordinates above 256 are not exact in bf16; cannot probe")
        shape = (block_size, num_kv_heads, head_dim)
        coords = [
            torch.arange(block_size).view(-1, 1, 1).expand(shape),
            torch.arange(num_kv_heads).view(1, -1, 1).expand(shape),
            torch.arange(head_dim).view(1, 1, -1).expand(shape),
        ]
        slots = torch.arange(block_size, 2 * block_size)
        maps = []
        for which in (0, 1):  # K, then V
            found = []
            for c in coords:
                scratch = torch.zeros((2, *block_shape), dtype=dtype)
                coded = (c + 1).to(dtype).contiguous()
                zero = torch.zeros(shape, dtype=dtype)
                write(coded if which == 0 else zero, zero if which == 0 else coded, scratch, slots)
                if scratch[0].any():
                    raise UnsupportedLayoutError("a write to block 1 changed block 0: the cache is not block-major")
                found.append(scratch[1].reshape(-1).float())
            written = found[0] > 0
            if int(written.sum()) != block_size * num_kv_heads * head_dim:
                raise UnsupportedLayoutError(f"probe wrote {int(written.sum())} values, expected one per slot")
            pos = written.nonzero().squeeze(1)
            t, h, d = ((f[pos] - 1).long() for f in found)
            index = torch.full(shape, -1, dtype=torch.long)
            index[t, h, d] = pos
            if (index < 0).any():
                raise UnsupportedLayoutError("probe could not place every (token, head, dim)")
            maps.append(index)
        if torch.isin(maps[0], maps[1]).any():
            raise UnsupportedLayoutError("K and V share offsets in the probed layout")
        return cls(maps[0], maps[1])

    def _address(self, slots: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        offsets = slots % self.block_size
        return blocks.unsqueeze(1), index[offsets].reshape(len(slots), -1)

    def _flat(self, cache: torch.Tensor) -> torch.Tensor:
        if not cache.is_contiguous():
            raise UnsupportedLayoutError("paged cache is not contiguous")
        return cache.view(cache.shape[0], -1)

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens at ``slots``, each ``[len(slots), kv_heads, head_dim]`` (new tensors)."""
        flat = self._flat(cache)
        n = len(slots)
        k = flat[self._address(slots, self.k_index)].view(n, self.num_kv_heads, self.head_dim)
        v = flat[self._address(slots, self.v_index)].view(n, self.num_kv_heads, self.head_dim)
        return k, v

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` (``[len(slots), kv_heads, head_dim]``) into the cache at ``slots``."""
        flat = self._flat(cache)
        n = len(slots)
        flat[self._address(slots, self.k_index)] = k.reshape(n, -1).to(cache.dtype)
        flat[self._address(slots, self.v_index)] = v.reshape(n, -1).to(cache.dtype)


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of a request's tokens ``[start, end)`` given its block table."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[torch.div(pos, block_size, rounding_mode="floor")] * block_size + pos % block_size
