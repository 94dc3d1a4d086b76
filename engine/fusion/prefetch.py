"""Loading stored KV a layer ahead of the compute that needs it.

Layers ``i+1..i+depth`` are on their way while layer i is recomputed. On CUDA the host-to-device
copies are issued from the calling thread onto a side stream, each layer into a slot of a small
ring of device buffers, and the compute stream waits on the copy's event on the device: the host
never blocks on an in-memory tier. Only sources whose reads block (disk, Redis) are read on
reader threads; their copies are issued as soon as a read is in.

Why not a thread per layer for everything: the copies of in-memory KV take microseconds to issue,
but a loader thread needs the GIL to issue them, and the compute thread holds it while it
launches kernels: measured on an H100, each layer's copies then trickled in over ~2 ms, gating
the whole pass at that pace.

``load_s`` is how long loading took: the longer of its two overlapping stages, the host reads
(the time at least one was running: two readers run side by side, and summing their reads counted
a disk's time twice, 0.40-0.49 s for passes that loaded in 0.20-0.25 s on an H200) and the device
copies;
``wait_s`` is how long the compute stream sat idle waiting for a layer, from the end of the
previous layer's work to the layer's KV being on the device.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from .segments import LayerSource

_Parts = list[tuple[torch.Tensor, torch.Tensor]]
DEPTH = 2  # layers loaded ahead of the one computed
RING_SLOTS = DEPTH + 1  # layer i's KV lands in slot i % RING_SLOTS of the device ring
READERS = 2  # reader threads of a process (a pass keeps DEPTH + 1 reads queued)
_reader_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the process's reader threads)
_reader_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    """The process's reader threads, shared by its passes: a pool made and shut down per pass cost a
    disk-bound pass ~0.5 ms of its TTFT (threads started at its first reads, joined after its last).
    A forked child makes its own, since its parent's threads do not exist in it."""
    global _reader_pool
    with _reader_pool_lock:
        if _reader_pool is None or _reader_pool[0] != os.getpid():
            _reader_pool = (os.getpid(), ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="ragfuse-kv-read"))
        return _reader_pool[1]


def start_reads(
    sources: list[LayerSource], num_layers: int, first: int = 0
) -> dict[int, Future[tuple[_Parts, tuple[float, float]]]]:
    """The reads a ``LayerPrefetcher`` over ``sources`` starts on entering (its first ``DEPTH + 1``
    layers from ``first``), started now where they block (disk, Redis; none otherwise). A fused pass
    works out its layout, graphs and skips on the host before its loader exists (~0.5 ms on an H200
    host), time a disk read can use. Hand them to the loader (``reads=``); a caller that fails before
    then ``drain``s them."""
    if not any(s.blocking for s in sources):
        return {}
    pool = _readers()
    return {i: pool.submit(_read_layer, sources, i) for i in range(first, min(first + DEPTH + 1, num_layers))}


def drain(reads: dict[int, Future[tuple[_Parts, tuple[float, float]]]]) -> None:
    """Cancel the reads not yet started and wait for the rest: their sources are closed next."""
    for f in reads.values():
        f.cancel()
    wait(list(reads.values()))


def _read_layer(sources: list[LayerSource], layer: int) -> tuple[_Parts, tuple[float, float]]:
    """Every source's KV of ``layer``, and the (start, end) of the reads."""
    t = time.perf_counter()
    parts = [s.load_layer(layer) for s in sources]
    return parts, (t, time.perf_counter())


class LayerPrefetcher:
    def __init__(
        self, sources: list[LayerSource], num_layers: int, device: torch.device,
        ring: tuple[torch.Tensor, torch.Tensor] | None = None, lazy: bool = False, skip: list[int] | None = None,
        reads: dict[int, Future[tuple[_Parts, tuple[float, float]]]] | None = None,
        first_layer: Callable[[tuple[torch.Tensor, torch.Tensor] | None], tuple[torch.Tensor, torch.Tensor]]
        | None = None,
    ) -> None:
        """``ring``: the device buffers to load into, [RING_SLOTS, rows, kv_heads, head_dim] each (a CUDA
        graph reads them at fixed addresses); by default made to fit the sources. ``lazy``: start
        with layer 0's loads only; the caller issues the rest with ``ahead`` once it has launched a
        layer's work (each layer's copies take ~0.2 ms of host time to issue, which before layer 0
        the GPU would sit out). ``skip``: per source, how many leading layers are not copied to the
        device (on CUDA; their rows then hold anything): the fusor's layers before its first check
        overwrite every fusable token's stored KV with its fresh one, so only an exact prefix's is read
        there, and the others' copies would only hold up the host before layer 0 (and the copy engine).
        They are still read, so a tier that promotes an entry once every layer was read still does
        (a disk entry whose layer 0 was computed, not read, reads it when it is promoted).
        ``reads``: those of ``start_reads`` over the same sources, already under way (from layer 1
        with ``first_layer``). ``first_layer(out)``: computes layer 0's stored (K before RoPE, V) on
        the current stream, into ``out`` (the ring's slot, where there is a ring) or new tensors; called
        by ``get(0)``. Layer 0 is then not read at all, and the reads start at layer 1 (the fusor's
        reason: a disk's first read is the one no compute can hide)."""
        self.sources = sources
        self._skip = skip or [0] * len(sources)
        self.num_layers = num_layers
        self.device = device
        self.depth = DEPTH
        blocking = any(s.blocking for s in sources)
        self._pool = _readers() if blocking else None
        self._reads: dict[int, Future[tuple[_Parts, tuple[float, float]]]] = dict(reads or {})
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ring = ring  # [RING_SLOTS, tokens, kv_heads, head_dim] each
        self._issued: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> its KV on the device
        self._copy_events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}  # layer -> copy (start, end)
        self._freed: dict[int, torch.cuda.Event] = {}  # layer -> compute done with its ring slot
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # compute stream: (asks, has) a layer
        # (start, end) of every read, on a reader thread or inline, and of the CPU's joins: reader threads
        # run beside each other and beside the joins, so their union, not their sum, is the time taken
        self._read_spans: list[tuple[float, float]] = []
        self._host_wait_s = 0.0
        self._first_layer = first_layer
        self._first = 0 if first_layer is None else 1  # the first layer read
        self._next_issue = self._first
        self._lazy = lazy

    def __enter__(self) -> LayerPrefetcher:
        if self._stream is not None:  # KV just computed on the device (not yet finished) is read on the side stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._pool is not None:
            for i in range(self._first, min(self._first + self.depth + 1, self.num_layers)):
                if i not in self._reads:
                    self._reads[i] = self._pool.submit(self._read, i)
        try:
            self._issue_ready(self._first if self._lazy else self._first + self.depth)
        except BaseException:  # a read that failed at once: ``__exit__`` never runs, so drain the others here
            drain(self._reads)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        drain(self._reads)  # a read still running (the pass failed midway) uses sources its caller closes next

    def _read(self, layer: int) -> tuple[_Parts, tuple[float, float]]:
        return _read_layer(self.sources, layer)

    def _parts(self, layer: int, wait: bool) -> _Parts | None:
        """Layer ``layer``'s host (or device) parts, or None while a blocking read is still running."""
        if self._pool is None:  # in-memory sources: views, read inline
            parts, span = self._read(layer)
            self._read_spans.append(span)
            return parts
        future = self._reads.get(layer)
        if future is None:
            future = self._reads[layer] = self._pool.submit(self._read, layer)
        if not wait and not future.done():
            return None
        t = time.perf_counter()
        parts, span = self._reads.pop(layer).result()
        self._host_wait_s += time.perf_counter() - t
        self._read_spans.append(span)
        ahead = layer + self.depth + 1
        if ahead < self.num_layers and ahead not in self._reads:  # keep the readers busy
            self._reads[ahead] = self._pool.submit(self._read, ahead)
        return parts

    def _issue_ready(self, upto: int, wait_for: int = -1) -> None:
        """Issue the loads of layers up to ``upto`` in order, as far as their reads are in (waiting
        for the reads of layers up to ``wait_for``)."""
        while self.sources and self._next_issue <= min(upto, self.num_layers - 1):
            layer = self._next_issue
            parts = self._parts(layer, wait=layer <= wait_for)
            if parts is None:
                return
            self._issued[layer] = self._place(layer, parts)
            self._next_issue += 1

    def _place(self, layer: int, parts: _Parts) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s parts joined on the device (copied on the side stream on CUDA)."""
        if self._stream is None:  # CPU: joined right here, nothing to overlap it with
            t = time.perf_counter()
            kv = torch.cat([p[0] for p in parts]).to(self.device), torch.cat([p[1] for p in parts]).to(self.device)
            self._read_spans.append((t, time.perf_counter()))
            self._host_wait_s += time.perf_counter() - t
            return kv
        if self._ring is None:
            k0 = parts[0][0]
            shape = (RING_SLOTS, sum(p[0].shape[0] for p in parts), *k0.shape[1:])
            self._ring = (torch.empty(shape, dtype=k0.dtype, device=self.device),
                          torch.empty(shape, dtype=k0.dtype, device=self.device))
        slot = layer % RING_SLOTS
        k_buf, v_buf = self._ring[0][slot], self._ring[1][slot]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            if layer > self.depth:  # the slot's previous layer must be done with before it is overwritten
                self._stream.wait_event(self._freed.pop(layer - self.depth - 1))
            start.record(self._stream)
            row = 0
            for (k, v), skip in zip(parts, self._skip, strict=True):
                if layer >= skip:
                    k_buf[row : row + k.shape[0]].copy_(k, non_blocking=True)
                    v_buf[row : row + k.shape[0]].copy_(v, non_blocking=True)
                row += k.shape[0]
            end.record(self._stream)
        self._copy_events[layer] = (start, end)
        return k_buf, v_buf

    def get(self, layer: int, ahead: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s stored (K before RoPE, V) for all segments, concatenated, on device (on
        CUDA: its ring slot, whose rows past the sources' tokens hold nothing of this pass).
        ``ahead``: issue the next layers' loads here too; without, the caller calls ``ahead``.

        Valid until ``get(layer + depth + 1)``: its ring slot is then refilled."""
        if layer == 0 and self._first_layer is not None:
            kv = self._computed_first()
            if ahead:
                self.ahead(0)
            return kv
        if self._stream is None:
            self._issue_ready(layer + self.depth, wait_for=layer)
            return self._issued.pop(layer)
        compute = torch.cuda.current_stream(self.device)
        asks, has = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        asks.record(compute)  # fires when the previous layer's work is done: its ring slot is free again
        if layer > 0:
            self._freed[layer - 1] = asks
        self._issue_ready(layer + self.depth if ahead else layer, wait_for=layer)
        compute.wait_event(self._copy_events[layer][1])
        has.record(compute)
        self._waits.append((asks, has))
        return self._issued.pop(layer)

    def _computed_first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0 from ``first_layer``, into its ring slot where there is a ring (a CUDA graph reads
        it there)."""
        assert self._first_layer is not None
        return self._first_layer(None if self._ring is None else (self._ring[0][0], self._ring[1][0]))

    def ahead(self, layer: int) -> None:
        """Issue the loads of the layers after ``layer`` (up to the depth) whose reads are in."""
        self._issue_ready(layer + self.depth)

    @property
    def load_s(self) -> float:
        """Loading time: the longer of the reads (inline, and the reader threads' busy time) and the
        device copies, which run beside the next layers' reads (call after the device is synchronized)."""
        copies = sum(s.elapsed_time(e) for s, e in self._copy_events.values()) / 1e3
        return max(_covered(self._read_spans), copies)

    @property
    def wait_s(self) -> float:
        """Time the compute waited for loading (call after the device is synchronized)."""
        if self._stream is None:
            return self._host_wait_s
        return sum(a.elapsed_time(h) for a, h in self._waits) / 1e3


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the (start, end) intervals: the time at least one of them was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
