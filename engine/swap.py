"""Host copies of preempted sequences whose KV cannot be recomputed as it was.

A plain sequence preempted under cache pressure is recomputed later by prefill: its tokens' KV comes
out as it was (exact either way). A fused prompt's KV (cache fusion) or a session turn's history is
not the KV a prefill computes: recomputing it would change the rest of the answer (the load on the
server would decide it) and would pay the full prefill that reuse saved. Such a sequence's pages are
copied to host memory instead (pinned on CUDA) and copied back into fresh pages when it resumes, so
it decodes on exactly the KV it had. Bounded by a byte budget; a sequence that would exceed it is
recomputed as before.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache

# blocks gathered per copy: bounds the device-side staging a swap needs while the cache is full
_CHUNK_BLOCKS = 64


class SwapSpace:
    def __init__(self, kv_cache: KVCache, budget_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._held: dict[str, torch.Tensor] = {}  # request id -> [layers, 2, blocks, block_size, heads, dim]
        self._pin = kv_cache.storage.device.type == "cuda"

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def swap_out(self, request_id: str, blocks: list[int]) -> bool:
        """Copy ``blocks`` (a sequence's pages, in order) to host memory; False, copying nothing,
        where the budget or the host's memory cannot take them. The copy is queued on the current
        stream, so pages given back afterwards are overwritten only after it has read them."""
        storage = self.kv_cache.storage
        shape = (*storage.shape[:2], len(blocks), *storage.shape[3:])
        nbytes = storage.element_size() * torch.Size(shape).numel()
        if self.used_bytes + nbytes > self.budget_bytes:
            return False
        try:
            host = torch.empty(shape, dtype=storage.dtype, pin_memory=self._pin)
        except RuntimeError:  # pinned memory exhausted: recompute instead
            return False
        for start in range(0, len(blocks), _CHUNK_BLOCKS):
            idx = torch.tensor(blocks[start:start + _CHUNK_BLOCKS], device=storage.device)
            host[:, :, start:start + len(idx)].copy_(storage[:, :, idx], non_blocking=self._pin)
        self._held[request_id] = host
        self.used_bytes += nbytes
        return True

    def swap_in(self, request_id: str, blocks: list[int]) -> None:
        """Copy a swapped sequence's pages back into ``blocks`` (as many as it gave) and free the host copy."""
        host = self._held.pop(request_id)
        storage = self.kv_cache.storage
        assert len(blocks) == host.shape[2], "swap_in needs as many blocks as were swapped out"
        for start in range(0, len(blocks), _CHUNK_BLOCKS):
            idx = torch.tensor(blocks[start:start + _CHUNK_BLOCKS], device=storage.device)
            storage[:, :, idx] = host[:, :, start:start + len(idx)].to(storage.device, non_blocking=self._pin)
        self.used_bytes -= host.element_size() * host.numel()

    def drop(self, request_id: str) -> None:
        """Forget a swapped sequence's copy (it was aborted or finished while swapped out)."""
        host = self._held.pop(request_id, None)
        if host is not None:
            self.used_bytes -= host.element_size() * host.numel()
