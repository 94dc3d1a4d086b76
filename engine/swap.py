"""Host copies of preempted sequences whose KV cannot be recomputed as it was.

A plain sequence preempted under cache pressure is recomputed later by prefill: its tokens' KV comes
out as it was (exact either way). A fused prompt's KV (cache fusion) or a session turn's history is
not the KV a prefill computes: recomputing it would change the rest of the answer (the load on the
server would decide it) and would pay the full prefill that reuse saved. Such a sequence's pages are
copied to host memory instead (pinned on CUDA) and copied back into fresh pages when it resumes, so
it decodes on exactly the KV it had. Bounded by a byte budget; a sequence that would exceed it is
recomputed as before.

On CUDA the copy back runs on a side stream, beside the running sequences' steps (a 388 MiB copy
held a Mistral-7B batch ~9 ms on the compute stream); the resumed sequence joins a step only once
its copy has landed (``arrived``). The copy out stays on the compute stream: the pages it reads are
given to other sequences in the same step.
"""

from __future__ import annotations

import contextlib

import torch

from .kv_cache import KVCache

# blocks per copy: bounds the device-side staging a swap needs while the cache is full, and how long
# a running step's own small host-to-device copies queue behind one chunk of a copy back (H200,
# Mistral-7B, 388 MiB back beside two decode steps of 16 requests: 64 blocks a chunk added 4.0 ms
# to the steps' 10 ms, 16 blocks 1.6 ms, 4-8 no less; the round trip is the same)
_CHUNK_BLOCKS = 16


class SwapSpace:
    def __init__(self, kv_cache: KVCache, budget_bytes: int) -> None:
        self.kv_cache = kv_cache
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        # request id -> its pages in runs of up to _CHUNK_BLOCKS, each [layers, 2, blocks, block_size, heads, dim]
        # and contiguous: a strided host view made each copy go through a pageable staging buffer (1 GB/s)
        self._held: dict[str, list[torch.Tensor]] = {}
        self._pin = kv_cache.storage.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv_cache.storage.device) if self._pin else None
        # request id -> (the copy back's event, its host runs: they must live until the copy has read them)
        self._arriving: dict[str, tuple[torch.cuda.Event, list[torch.Tensor]]] = {}

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def swap_out(self, request_id: str, blocks: list[int]) -> bool:
        """Copy ``blocks`` (a sequence's pages, in order) to host memory; False, copying nothing,
        where the budget or the host's memory cannot take them. The copies are queued on the current
        stream, so pages given back afterwards are overwritten only after they have been read."""
        storage = self.kv_cache.storage
        per_block = storage[:, :, 0].numel() * storage.element_size()
        if self.used_bytes + per_block * len(blocks) > self.budget_bytes:
            return False
        runs = [blocks[i:i + _CHUNK_BLOCKS] for i in range(0, len(blocks), _CHUNK_BLOCKS)]
        try:
            host = [torch.empty((*storage.shape[:2], len(run), *storage.shape[3:]), dtype=storage.dtype,
                                pin_memory=self._pin) for run in runs]
        except RuntimeError:  # pinned memory exhausted: recompute instead
            return False
        idx = self._device_index(blocks)
        for i, dst in enumerate(host):
            dst.copy_(storage[:, :, idx[i * _CHUNK_BLOCKS:(i + 1) * _CHUNK_BLOCKS]], non_blocking=self._pin)
        self._held[request_id] = host
        self.used_bytes += per_block * len(blocks)
        return True

    def swap_in(self, request_id: str, blocks: list[int]) -> None:
        """Copy a swapped sequence's pages back into ``blocks`` (as many as it gave) and free the host
        copy; on CUDA the copy is queued on the side stream, after the work already queued on the
        compute stream (the blocks' previous owner may still be using them)."""
        host = self._held.pop(request_id)
        storage = self.kv_cache.storage
        assert len(blocks) == sum(h.shape[2] for h in host), "swap_in needs as many blocks as were swapped out"
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(storage.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            idx = self._device_index(blocks)
            start = 0
            for src in host:
                storage[:, :, idx[start:start + src.shape[2]]] = src.to(storage.device, non_blocking=self._pin)
                start += src.shape[2]
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
                self._arriving[request_id] = (event, host)
        self.used_bytes -= _nbytes(host)

    def _device_index(self, blocks: list[int]) -> torch.Tensor:
        """``blocks`` as an index on the cache's device, sent from page-locked memory on CUDA: a
        tensor made from a list goes through pageable memory, whose copy first waits for the stream
        to drain, so the host sat out each earlier chunk's copy (and a copy back, the compute
        stream's queued steps) before it could queue anything else."""
        idx = torch.tensor(blocks, dtype=torch.long)
        return idx.pin_memory().to(self.kv_cache.storage.device, non_blocking=True) if self._pin else idx

    def arrived(self, request_id: str) -> bool:
        """Whether a sequence's pages are in the cache: not swapped, or its copy back has landed."""
        pending = self._arriving.get(request_id)
        if pending is not None and not pending[0].query():
            return False
        self._arriving.pop(request_id, None)
        return True

    def await_arrivals(self, request_id: str | None = None) -> bool:
        """Make the compute stream wait for the copies back still on their way (one request's, or
        all): before its pages are read or given away outside a scheduled step. Whether any was."""
        ids = list(self._arriving) if request_id is None else [request_id] if request_id in self._arriving else []
        for rid in ids:
            event, _ = self._arriving.pop(rid)
            torch.cuda.current_stream(self.kv_cache.storage.device).wait_event(event)
        return bool(ids)

    def gather(self, request_id: str, kept: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a swapped sequence's first ``num_tokens`` tokens, as ``KVCache.gather`` gives
        them for a sequence in the cache (new tensors on the cache's device): its ``kept`` leading
        blocks (a shared prefix that stayed in the cache) and then its host copy. A session turn
        preempted before its closing step is saved from here."""
        storage = self.kv_cache.storage
        parts = [storage[:, :, self._device_index(kept)]] if kept else []
        parts += [h.to(storage.device, non_blocking=self._pin) for h in self._held[request_id]]
        kv = torch.cat(parts, dim=2).flatten(2, 3)[:, :, :num_tokens]
        return kv[:, 0], kv[:, 1]

    def drop(self, request_id: str) -> None:
        """Forget a swapped sequence's copy (it was aborted or finished while swapped out, or while
        its copy back was on its way: its blocks are given back, so later work waits for that copy)."""
        self.await_arrivals(request_id)
        host = self._held.pop(request_id, None)
        if host is not None:
            self.used_bytes -= _nbytes(host)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
