"""A stored session's KV as a fusor layer source: read one layer at a time, rows picked on the way.

The fusor's loader asks for layer i+1 while layer i of the new tokens is computed, which is
AttentionStore's layer-wise pre-loading. A session in host memory hands out views (page-locked, so
the copy to a GPU is asynchronous); a session on disk is read into a small ring of page-locked
layer buffers and every layer is checked against its checksum before use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..kvstore import CorruptEntryError, DiskEntryReader, EntryMeta


class SessionCorruptError(CorruptEntryError):
    """A session's stored KV failed its checksum (or vanished): the turn recomputes the history."""

    def __init__(self, session_id: str, why: str) -> None:
        super().__init__(f"session {session_id} {why}")
        self.session_id = session_id
        self.why = why


RING = 4  # layer buffers for disk reads: the loader holds at most three layers at once (depth 2)


class SessionSource:
    """``rows``: which stored rows are fed (None: the first ``num_tokens`` rows)."""

    blocking = True  # disk reads, or a wait for a staged copy

    def __init__(
        self, tier: str, read: Callable[[int], torch.Tensor], num_layers: int, num_tokens: int,
        rows: list[int] | None, session_id: str, close: Callable[[], None] | None = None,
    ) -> None:
        self.tier = tier
        self.session_id = session_id
        self.num_tokens = num_tokens
        self._read = read
        self._rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        self._close = close
        self.num_layers = num_layers
        self._staged: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None
        self.stage_start: torch.cuda.Event | None = None

    def stage(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        """Start copying every layer of a host-memory session to ``device`` now, all on ``stream``
        with an event per layer, so the copy engine streams the whole history back to back while
        the new tokens are computed layer by layer (the loader then only waits for each layer's
        event). Called when the turn is scheduled, or earlier (a read buffer filled while the
        previous job runs). Disk sessions are read layer by layer instead."""
        if self.tier != "cpu" or device.type != "cuda" or self._staged is not None:
            return
        staged: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.stage_start = torch.cuda.Event(enable_timing=True)
            self.stage_start.record(stream)
            for i in range(self.num_layers):
                t = self._read(i)
                if self._rows is not None:  # rows are picked on the device
                    g = t.to(device, non_blocking=True)
                else:
                    g = torch.empty((2, self.num_tokens, *t.shape[2:]), dtype=t.dtype, device=device)
                    g[0].copy_(t[0, : self.num_tokens], non_blocking=True)
                    g[1].copy_(t[1, : self.num_tokens], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                staged.append((g, ev))
        self._staged = staged

    @property
    def staged(self) -> bool:
        return self._staged is not None

    def layer_on_device(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """A staged layer's (K without position, V) for the current stream, which waits on the
        device for its copy (the host never blocks), and the copy's event."""
        assert self._staged is not None, "stage first"
        t, ev = self._staged[layer]
        torch.cuda.current_stream(t.device).wait_event(ev)
        if self._rows is None:
            return t[0], t[1], ev
        rows = self._rows.to(t.device, non_blocking=True)
        return t[0].index_select(0, rows), t[1].index_select(0, rows), ev

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._staged is not None:
            t, ev = self._staged[layer]
            ev.synchronize()
            if self._rows is None:
                return t[0], t[1]
            rows = self._rows.to(t.device)
            return t[0].index_select(0, rows), t[1].index_select(0, rows)
        try:
            t = self._read(layer)
        except CorruptEntryError as exc:
            raise SessionCorruptError(self.session_id, f"failed its checksum ({exc})") from exc
        if self._rows is None:
            return t[0, : self.num_tokens], t[1, : self.num_tokens]
        return t[0].index_select(0, self._rows), t[1].index_select(0, self._rows)

    def finish(self) -> None:
        self._staged = None
        if self._close is not None:
            self._close()
            self._close = None


def memory_source(
    layers: list[torch.Tensor], num_tokens: int, rows: list[int] | None, session_id: str
) -> SessionSource:
    return SessionSource("cpu", lambda i: layers[i], len(layers), num_tokens, rows, session_id)


def disk_source(reader: DiskEntryReader, num_tokens: int, rows: list[int] | None, session_id: str) -> SessionSource:
    """Layers read and verified on demand; a bad checksum raises ``CorruptEntryError``."""
    meta: EntryMeta = reader.meta
    pin = torch.cuda.is_available()
    ring = [torch.empty(meta.layer_shape, dtype=meta.dtype, pin_memory=pin) for _ in range(min(RING, meta.num_layers))]
    lock = threading.Lock()  # one file offset: the loader's two workers take turns

    def read(i: int) -> torch.Tensor:
        with lock:
            return reader.read_layer(i, ring[i % len(ring)])

    return SessionSource("disk", read, meta.num_layers, num_tokens, rows, session_id, reader.close)
