"""Reusable host buffers for entries read from disk into CPU memory.

Why: a chunk's KV is tens of MB (67 MB for 512 tokens of a Mistral-7B shape), so every fresh
``torch.empty`` of it is a new ``mmap`` whose pages the kernel must fault in and zero one by one on
first touch, inside the read. On the shared 2-core machine that costs about as much as reading the
file itself (faulting 6 x 67 MB took longer than reading them from disk). A buffer that was
already touched once costs nothing to fill again, so the disk tier reads into buffers taken from
this pool.

Safety: a buffer is handed out again only after every tensor over it (the entry's layers, their
views, a memory tier that kept the entry) has been freed. Each handout wraps the buffer in a fresh
numpy view; the tensor's storage holds that view, and a ``weakref.finalize`` on it hands the buffer
back only when the storage lets go. Nobody's live data is ever overwritten.

Cost: the pool keeps at most ``max_idle_bytes`` of buffers that nobody uses (what a process would
otherwise give back to the OS); buffers in use are their holders' memory, not the pool's.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_MAX_IDLE_BYTES = 512 << 20  # room for the KV of 6 chunks x 512 tokens of a 7B model, and more


@dataclass
class PoolStats:
    reused: int = 0  # handouts of a buffer that was already touched
    dropped: int = 0  # buffers given back to the OS because the idle limit was reached


class HostBufferPool:
    """CPU byte buffers by exact size, handed out again once every tensor over them is gone."""

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES) -> None:
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.max_idle_bytes = max_idle_bytes
        self._idle: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._idle_bytes = 0
        # reentrant: a finalizer may hand a buffer back on this very thread while ``take`` holds the lock
        self._lock = threading.RLock()
        self.stats = PoolStats()

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of ``nbytes`` bytes, contents undefined, yours until you drop it."""
        if self.max_idle_bytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            free = self._idle[nbytes]
            if free:
                base = free.pop()
                self._idle_bytes -= nbytes
                self.stats.reused += 1
            else:
                base = np.empty(nbytes, dtype=np.uint8)
        handout = base[:]  # a new array object over the same memory: its death means the tensor's death
        weakref.finalize(handout, self._give_back, base).atexit = False
        return torch.from_numpy(handout)

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + base.nbytes > self.max_idle_bytes:
                self.stats.dropped += 1
                return
            self._idle[base.nbytes].append(base)
            self._idle_bytes += base.nbytes

    def clear(self) -> None:
        """Give every idle buffer back to the OS."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


_shared: HostBufferPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> HostBufferPool:
    """The process-wide pool the disk tiers read into by default: one idle limit for the process,
    however many stores (documents, sessions) it opens."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HostBufferPool()
        return _shared
