"""Loading stored KV a layer ahead of the compute that needs it.

A loader thread reads layer i+1 (and i+2) of every stored segment while layer i is recomputed;
on CUDA the host-to-device copy runs on a side stream into pinned staging, and the compute stream
waits on an event only when it needs that layer. ``wait_s`` is the part of loading that was not
hidden behind compute.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .segments import LayerSource

_Loaded = tuple[torch.Tensor, torch.Tensor, "torch.cuda.Event | None", float]


class LayerPrefetcher:
    def __init__(
        self, sources: list[LayerSource], num_layers: int, device: torch.device, depth: int = 2, workers: int = 2
    ) -> None:
        self.sources = sources
        self.num_layers = num_layers
        self.device = device
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ragfuse-kv-load")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: dict[int, Future[_Loaded]] = {}
        self.load_s = 0.0  # time spent loading, summed over layers
        self.wait_s = 0.0  # time the compute waited for a layer

    def __enter__(self) -> LayerPrefetcher:
        for i in range(min(self.depth, self.num_layers)):
            self._start(i)
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pool.shutdown(wait=True)

    def _start(self, layer: int) -> None:
        if layer < self.num_layers and layer not in self._pending:
            self._pending[layer] = self._pool.submit(self._load, layer)

    def _load(self, layer: int) -> _Loaded:
        t = time.perf_counter()
        parts = [s.load_layer(layer) for s in self.sources]
        event = None
        if self._stream is not None:
            # each part is copied as it is (pinned host memory copies asynchronously), then joined
            # on the device, all on the side stream
            with torch.cuda.stream(self._stream):
                k = torch.cat([p[0].to(self.device, non_blocking=True) for p in parts])
                v = torch.cat([p[1].to(self.device, non_blocking=True) for p in parts])
                event = torch.cuda.Event()
                event.record(self._stream)
            event.synchronize()
        else:
            k = torch.cat([p[0] for p in parts]).to(self.device)
            v = torch.cat([p[1] for p in parts]).to(self.device)
        return k, v, event, time.perf_counter() - t

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s stored (K before RoPE, V) for all segments, concatenated, on device."""
        self._start(layer)
        t = time.perf_counter()
        k, v, event, took = self._pending.pop(layer).result()
        self.wait_s += time.perf_counter() - t
        self.load_s += took
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._start(layer + self.depth)
        return k, v
