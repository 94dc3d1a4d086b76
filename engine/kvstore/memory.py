"""Memory tiers: a GPU pool and a CPU pool (page-locked when a GPU is there to copy to)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .entry import KVStoreError, StoredKV
from .tier import Tier, TierStats


class MemoryTier(Tier):
    """An LRU pool of entries held as tensors on one device.

    The CPU pool pins its tensors when CUDA is present: only page-locked memory lets the copy to
    the GPU run asynchronously at full PCIe speed, which is what the fusor overlaps with compute.

    Every call holds the tier's lock: savers (the vLLM connector's save thread, a session's async
    save) put and evict while loaders get and a scheduler looks up, all in one process, and an
    eviction seen half-done fails a lookup or corrupts the byte count.
    """

    persistent = False

    def __init__(self, name: str, device: torch.device | str, capacity_bytes: int, pin: bool | None = None) -> None:
        self.name = name
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise KVStoreError(f"tier {name!r} wants {self.device} but no CUDA device is available")
        self.capacity_bytes = int(capacity_bytes)
        self.pin = (torch.cuda.is_available() if pin is None else pin) and self.device.type == "cpu"
        self._entries: OrderedDict[str, StoredKV] = OrderedDict()
        self._bytes = 0
        self._stats = TierStats(capacity=self.capacity_bytes)
        self._lock = threading.RLock()

    def get(self, key: str, device: torch.device | None = None) -> StoredKV | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
        if device is None or torch.device(device) == self.device:
            return entry
        return entry.to(device)

    def put(self, entry: StoredKV, keep_evicted: bool = True) -> list[StoredKV]:
        if entry.nbytes > self.capacity_bytes:
            return [entry]  # never fits: hand it straight down
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
                return []
        # the copy (pinning on a GPU host) runs unlocked: lookups need not wait for it
        local = entry if entry.device == self.device and not self.pin else entry.to(self.device, pin=self.pin)
        with self._lock:
            if entry.key in self._entries:  # another thread put it meanwhile
                return []
            evicted: list[StoredKV] = []
            while self._bytes + entry.nbytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self._stats.evictions += 1
                evicted.append(old)
            self._entries[entry.key] = local
            self._bytes += entry.nbytes
        return evicted

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._bytes -= entry.nbytes
            return True

    def close(self) -> None:
        """Drop every entry: a closed store's pool would otherwise hold its tensors (GiBs of pinned
        host or GPU memory) for as long as anything still refers to the store object."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.bytes = self._bytes
            self._stats.entries = len(self._entries)
            return self._stats
