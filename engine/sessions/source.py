"""A stored session's KV as a fusor layer source: read one layer at a time, rows picked on the way.

The fusor's loader asks for layer i+1 while layer i of the new tokens is computed, which is
AttentionStore's layer-wise pre-loading. A session in host memory hands out views (page-locked, so
the copy to a GPU is asynchronous); a session on disk is read into a small ring of page-locked
layer buffers and every layer is checked against its checksum before use.
"""

from __future__ import annotations

import math
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


def read_buffer_layers(num_layers: int, load_s: float, prefill_s: float) -> int:
    """Layers of the history to copy into the read buffer before the turn starts, so that copying
    the rest layer by layer during the turn never stalls it (AttentionStore's buffer size,
    ``B (T_load L_hist - T_pref L_new)``, in whole layers).

    With the copy of a layer taking ``c = load_s / L`` and the turn's compute ``f = prefill_s / L``
    a layer, layer ``i >= k`` lands ``(i - k + 1) c`` after the turn starts and is needed at
    ``i f``; the worst case is the first layer when copying is the faster (k = 1: no gap before
    layer 0) and the last one when it is the slower (k = L - (L - 1) f / c).
    """
    if num_layers <= 0 or load_s <= 0:
        return 0
    if prefill_s <= 0:
        return num_layers
    need = num_layers - (num_layers - 1) * prefill_s / load_s
    return min(num_layers, max(1, math.ceil(need - 1e-9)))


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
        self._staged: list[torch.cuda.Event] | None = None  # per layer: its copy is done
        self._buffer: torch.Tensor | None = None  # the staged history [layers, K/V, rows, kv_heads, head_dim]
        self.stage_start: torch.cuda.Event | None = None
        self._rows_on_device: torch.Tensor | None = None

    def stage(self, device: torch.device, stream: torch.cuda.Stream, layers: int | None = None) -> None:
        """Start copying a host-memory session's layers to ``device`` now, on ``stream`` with an
        event per layer, so the copy engine streams them back to back while the new tokens are
        computed layer by layer (the loader then only waits for each layer's event). Disk sessions
        are read layer by layer instead.

        ``layers``: copy only the first ``layers``; a later call goes on from there. The read
        buffer is filled so while the previous job runs or the turn waits in the queue
        (``read_buffer_layers`` sizes it), and a turn queues the rest a few layers ahead of its
        forward (``HistoryWriter``): queuing all 64 copies before layer 0 held the forward's start
        back by their host time. All layers land in one device buffer."""
        if self.tier != "cpu" or device.type != "cuda":
            return
        upto = self.num_layers if layers is None else min(layers, self.num_layers)
        done = len(self._staged) if self._staged is not None else 0
        if upto <= done:
            return
        if self._buffer is None:
            # the buffer may reuse memory a previous turn's streams read until the compute stream's
            # point now: copy into it only after that (later calls only append to this stream)
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if self._buffer is None:
                self.stage_start = torch.cuda.Event(enable_timing=True)
                self.stage_start.record(stream)
                first = self._read(0)
                rows = first.shape[1] if self._rows is not None else self.num_tokens  # rows picked on the device
                self._buffer = torch.empty((self.num_layers, 2, rows, *first.shape[2:]), dtype=first.dtype,
                                           device=device)
                self._staged = []
            buf, staged = self._buffer, self._staged
            assert staged is not None
            for i in range(done, upto):
                t = self._read(i)
                if t.shape[1] == buf.shape[2]:  # the stored rows are exactly the fed ones: one copy
                    buf[i].copy_(t, non_blocking=True)
                else:
                    buf[i, 0].copy_(t[0, : buf.shape[2]], non_blocking=True)
                    buf[i, 1].copy_(t[1, : buf.shape[2]], non_blocking=True)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                staged.append(ev)

    @property
    def staged(self) -> bool:
        """Whether copying to the device has started (some layers, or all)."""
        return self._staged is not None

    @property
    def staged_layers(self) -> int:
        """Layers whose copies are queued (or done): the read buffer's before the turn starts."""
        return len(self._staged) if self._staged is not None else 0

    def staged_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]:
        """A staged layer for the current stream, which waits on the device for its copy (the host
        never blocks): its stored rows [2, rows, kv_heads, head_dim] (K without position, V), the
        fed rows' indices on the device (None: the first ``num_tokens``), and the copy's event."""
        assert self._staged is not None and self._buffer is not None, "stage first"
        ev = self._staged[layer]
        stream = torch.cuda.current_stream(self._buffer.device)
        stream.wait_event(ev)
        if self._rows is not None and self._rows_on_device is None:
            self._rows_on_device = self._rows.to(self._buffer.device, non_blocking=True)
        return self._buffer[layer], self._rows_on_device, ev

    def _pick(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The fed rows of staged ``t`` along ``dim`` (all of them without a cut)."""
        if self._rows is None:
            return t
        return t.index_select(dim, self._rows.to(t.device, non_blocking=True))

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._staged is not None and self._buffer is not None:
            self._staged[layer].synchronize()
            k, v = self._buffer[layer]
            return self._pick(k, 0), self._pick(v, 0)
        try:
            t = self._read(layer)
        except CorruptEntryError as exc:
            raise SessionCorruptError(self.session_id, f"failed its checksum ({exc})") from exc
        if self._rows is None:
            return t[0, : self.num_tokens], t[1, : self.num_tokens]
        return t[0].index_select(0, self._rows), t[1].index_select(0, self._rows)

    def finish(self) -> None:
        self._staged = None
        self._buffer = None
        self._rows_on_device = None
        if self._close is not None:
            self._close()
            self._close = None


def memory_source(
    layers: list[torch.Tensor], num_tokens: int, rows: list[int] | None, session_id: str,
    close: Callable[[], None] | None = None,
) -> SessionSource:
    return SessionSource("cpu", lambda i: layers[i], len(layers), num_tokens, rows, session_id, close)


def disk_source(
    reader: DiskEntryReader, num_tokens: int, rows: list[int] | None, session_id: str,
    close: Callable[[], None] | None = None,
) -> SessionSource:
    """Layers read and verified on demand; a bad checksum raises ``CorruptEntryError``. ``close``
    runs after the reader is closed."""
    meta: EntryMeta = reader.meta
    pin = torch.cuda.is_available()
    ring = [torch.empty(meta.layer_shape, dtype=meta.dtype, pin_memory=pin) for _ in range(min(RING, meta.num_layers))]
    lock = threading.Lock()  # one file offset: the loader's two workers take turns

    def read(i: int) -> torch.Tensor:
        reader.read_ahead(i)  # the next layers on their way before this read waits for the lock
        with lock:
            return reader.read_layer(i, ring[i % len(ring)])

    def finish() -> None:
        reader.close()
        if close is not None:
            close()

    return SessionSource("disk", read, meta.num_layers, num_tokens, rows, session_id, finish)
