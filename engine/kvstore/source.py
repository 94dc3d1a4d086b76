"""Stored entries as the fusor's layer sources: each layer is read when the fusor's loader asks.

An entry in a memory tier hands out views of its tensors. An entry on disk or in Redis is read and
verified one layer at a time, so the read of layer i+1 overlaps the recompute of layer i. Layers
read from a slower tier are collected, and once all have arrived the whole entry is promoted to the
store's top tier, as a ``TieredKVStore.get`` hit would be.
"""

from __future__ import annotations

import logging
import threading

import torch

from .disk import DiskEntryReader, DiskTier
from .entry import CorruptEntryError, KVShape, KVStoreError, StoredKV, UnreadableEntryError
from .redis_tier import RedisTier
from .store import TieredKVStore

log = logging.getLogger("ragfuse.kvstore")


class EntrySource:
    """An entry already in memory (a GPU or CPU pool, or just computed)."""

    blocking = False

    def __init__(self, entry: StoredKV, tier: str) -> None:
        self.entry = entry
        self.tier = tier
        self.meta = entry.meta
        self.num_tokens = entry.meta.num_tokens

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.entry.layer(layer)

    def finish(self) -> None:
        """Nothing to promote: the entry is in memory already."""


class LayerwiseSource:
    """An entry in a persistent tier (disk or Redis), read and verified a layer at a time."""

    blocking = True

    def __init__(self, store: TieredKVStore, tier: DiskTier | RedisTier, key: str) -> None:
        self.store = store
        self.tier = tier.name
        self._tier = tier
        self.key = key
        self._reader: DiskEntryReader | None = None
        if isinstance(tier, DiskTier):
            try:
                self._reader = tier.open(key)
            except OSError as exc:  # a failing disk: recompute, keep the entry (as for a layer read)
                raise UnreadableEntryError(f"KV entry {key} could not be opened: {exc}", key) from exc
            if self._reader is None:
                raise KeyError(key)
            self.meta = self._reader.meta
        else:
            meta = tier.meta(key)
            if meta is None:
                raise KeyError(key)
            self.meta = meta
        self.num_tokens = self.meta.num_tokens
        # with a GPU, layers land in page-locked memory so their copies to it run asynchronously
        self._buffer = torch.empty(
            (self.meta.num_layers, *self.meta.layer_shape), dtype=self.meta.dtype,
            pin_memory=torch.cuda.is_available(),
        )
        self._layers: list[torch.Tensor | None] = [None] * self.meta.num_layers
        self._lock = threading.Lock()  # the loader may read two layers at once; a file has one offset

    def load_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises ``CorruptEntryError`` when the layer fails its checksum: the caller drops the
        entry (``drop``) and recomputes the chunk, never serving what was read; and
        ``UnreadableEntryError`` when it cannot be read at all: the caller recomputes the chunk."""
        if self._reader is not None:  # the next layers on their way before this read waits for the lock
            self._reader.read_ahead(layer)
        with self._lock:
            try:
                if self._reader is not None:
                    t = self._reader.read_layer(layer, self._buffer[layer])
                else:
                    assert isinstance(self._tier, RedisTier)
                    t = self._buffer[layer].copy_(self._tier.read_layer(self.key, self.meta, layer))
            except CorruptEntryError as exc:
                exc.key = self.key  # which entry to drop and recompute
                raise
            except (OSError, KVStoreError) as exc:  # a failing disk, Redis gone: recompute, keep the entry
                raise UnreadableEntryError(f"KV entry {self.key} could not be read: {exc}", self.key) from exc
        self._layers[layer] = t
        return t[0], t[1]

    def finish(self) -> None:
        """Close the reader; promote the entry to the top tier if every layer was read. A fused pass
        computes layer 0 instead of reading it (``fuse_prefill``): that layer is read here, and
        checked, before the entry is promoted; one that fails its checksum drops the entry."""
        promote = self.store.tiers[0].name != self.tier
        later = self._layers[1:]
        first_skipped = self._layers[0] is None and bool(later) and all(t is not None for t in later)
        if promote and first_skipped:
            try:
                self.load_layer(0)
            except CorruptEntryError as exc:
                log.warning("KV entry %s dropped: %s", self.key, exc)
                self.drop()
                return
            except UnreadableEntryError as exc:  # kept where it is, not promoted
                log.warning("KV entry %s not promoted: %s", self.key, exc)
        if self._reader is not None:
            self._reader.close()
        if promote and all(t is not None for t in self._layers):
            self.store.put_top(StoredKV(self.meta, [t for t in self._layers if t is not None]))

    def drop(self) -> None:
        """The entry is corrupt: close its reader, remove it from its tier (counted there)."""
        if self._reader is not None:
            self._reader.close()
        self._tier.drop(self.key)


def open_source(
    store: TieredKVStore, key: str, shape: KVShape | None = None, num_tokens: int | None = None,
    damaged: list[str] | None = None,
) -> EntrySource | LayerwiseSource | None:
    """A layer source for ``key`` from the fastest tier that holds it, or None on a miss.

    With ``shape`` (the reading model's) and ``num_tokens`` (its text's), an entry whose metadata
    says otherwise is corrupt: it is dropped from its tier (counted, its reader closed) and the
    next tier is tried, so the caller's recomputed KV can be stored in its place. So is an entry
    that does not open (an empty file, a damaged header). Each one dropped is told in ``damaged``
    (its tier and why), so the caller can say the KV it recomputes replaces damaged KV."""
    for tier in store.tiers:
        if not tier.contains(key):
            continue
        src: EntrySource | LayerwiseSource
        if isinstance(tier, DiskTier | RedisTier):
            try:
                src = LayerwiseSource(store, tier, key)
            except KeyError:  # gone since ``contains`` (evicted)
                continue
            except CorruptEntryError as exc:  # dropped by the tier
                if damaged is not None:
                    damaged.append(f"{tier.name}: {exc}")
                continue
        else:
            entry = tier.get(key)
            if entry is None:
                continue
            src = EntrySource(entry, tier.name)
        why = shape.mismatch(src.meta, num_tokens) if shape is not None else None
        if why is None:
            return src
        log.warning("KV entry %s in tier %s %s: dropped", key, tier.name, why)
        if damaged is not None:
            damaged.append(f"{tier.name}: {why}")
        if isinstance(src, LayerwiseSource):
            src.drop()
        else:
            tier.drop(key)
    return None
