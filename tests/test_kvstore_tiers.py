"""Tier behaviour: LRU eviction, demotion down the tiers, promotion on hit, stats, layer reads."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from safetensors import safe_open

from ragfuse.engine.kvstore import DiskTier, MemoryTier, StoredKV, TieredKVStore, kv_key
from ragfuse.engine.kvstore import disk as disk_module
from ragfuse.engine.kvstore.source import LayerwiseSource, open_source
from tests.kvstore_helpers import LAYERS, make_entry, same


def test_key_is_position_free_and_model_specific():
    ids = [5, 6, 7]
    assert kv_key("m", torch.float32, ids) == kv_key("m", torch.float32, list(ids))
    assert kv_key("m", torch.float32, ids) != kv_key("m", torch.bfloat16, ids)
    assert kv_key("m", torch.float32, ids) != kv_key("other", torch.float32, ids)
    assert kv_key("m", torch.float32, ids) != kv_key("m", torch.float32, [5, 6, 8])
    # the tokens a chunk's KV was computed after are part of its key; none keeps the key as it was
    assert kv_key("m", torch.float32, ids, ()) == kv_key("m", torch.float32, ids)
    assert kv_key("m", torch.float32, ids, [1, 2]) != kv_key("m", torch.float32, ids)
    assert kv_key("m", torch.float32, ids, [1, 2]) != kv_key("m", torch.float32, ids, [1, 3])
    assert kv_key("m", torch.float32, [2, *ids], [1]) != kv_key("m", torch.float32, ids, [1, 2])


def test_memory_tier_evicts_least_recently_used():
    e = [make_entry(i) for i in range(3)]
    tier = MemoryTier("cpu", "cpu", capacity_bytes=2 * e[0].nbytes)
    assert tier.put(e[0]) == [] and tier.put(e[1]) == []
    assert tier.get(e[0].key) is not None  # e[1] is now the least recently used
    evicted = tier.put(e[2])
    assert [x.key for x in evicted] == [e[1].key]
    s = tier.stats()
    assert (s.hits, s.evictions, s.entries, s.bytes) == (1, 1, 2, 2 * e[0].nbytes)
    assert tier.get(e[1].key) is None and tier.stats().misses == 1


def test_demotion_cascades_and_hits_are_promoted(tmp_path):
    e = [make_entry(i) for i in range(4)]
    size = e[0].nbytes
    cpu = MemoryTier("cpu", "cpu", capacity_bytes=size)
    disk = DiskTier(tmp_path / "kv", capacity_bytes=10 * (size + 4096))
    store = TieredKVStore([cpu, disk])
    for x in e:
        store.put(x)
    assert store.locate(e[-1].key) == "cpu"
    assert all(store.locate(x.key) == "disk" for x in e[:-1])  # pushed out of memory, kept on disk
    got = store.get(e[0].key)
    assert got is not None and same(got, e[0])
    assert store.locate(e[0].key) == "cpu" and disk.contains(e[0].key)  # promoted; disk keeps its copy
    assert store.locate(e[-1].key) == "disk"  # demoted to make room
    stats = store.stats()
    assert stats["cpu"].misses == 1 and stats["disk"].hits == 1 and stats["cpu"].evictions >= 4


def test_persist_writes_an_entry_only_memory_holds_through_to_disk(tmp_path):
    """An upload counted a server's hot chunk as stored although its disk copy was gone (removed by
    `store rm` beside the server): after a restart, or for another process, it was missing."""
    e = make_entry(0)
    cpu = MemoryTier("cpu", "cpu", capacity_bytes=4 * e.nbytes)
    disk = DiskTier(tmp_path / "kv", capacity_bytes=4 * (e.nbytes + 4096))
    store = TieredKVStore([cpu, disk])
    store.put(e)
    assert disk.delete(e.key) and store.locate(e.key) == "cpu"
    assert store.persist(e.key) and disk.contains(e.key)
    got = disk.get(e.key)
    assert got is not None and same(got, e)
    assert not store.persist(make_entry(1).key)  # held nowhere: not stored
    assert TieredKVStore([MemoryTier("m", "cpu", capacity_bytes=e.nbytes)]).persist(e.key) is False


def test_memory_to_memory_promotion_moves(tmp_path):
    e = [make_entry(i) for i in range(3)]
    top = MemoryTier("fast", "cpu", capacity_bytes=e[0].nbytes)
    mid = MemoryTier("cpu", "cpu", capacity_bytes=4 * e[0].nbytes)
    store = TieredKVStore([top, mid])
    for x in e:
        store.put(x)
    assert store.get(e[0].key) is not None
    assert top.contains(e[0].key) and not mid.contains(e[0].key) and mid.contains(e[2].key)


def test_disk_tier_evicts_lru_and_out_of_last_tier_is_gone(tmp_path):
    e = [make_entry(i) for i in range(3)]
    disk = DiskTier(tmp_path, capacity_bytes=2 * e[0].nbytes + 8192)
    store = TieredKVStore([disk])
    store.put(e[0])
    store.put(e[1])
    assert store.get(e[0].key) is not None
    store.put(e[2])
    assert not disk.contains(e[1].key) and disk.contains(e[0].key) and disk.contains(e[2].key)
    assert disk.stats().evictions == 1 and disk.stats().bytes <= disk.capacity_bytes
    assert len(list((tmp_path / "data").glob("*/*.safetensors"))) == 2


def test_disk_layout_is_safetensors_readable_layer_by_layer(tmp_path):
    e = make_entry(7, dtype=torch.bfloat16)
    disk = DiskTier(tmp_path, capacity_bytes=1 << 30)
    disk.put(e)
    with safe_open(str(disk.path_of(e.key)), "pt") as f:
        assert torch.equal(f.get_tensor("layer.0002"), e.layers[2])
    reader = disk.open(e.key)
    with reader:
        k, v = e.layer(LAYERS - 1)
        layer = reader.read_layer(LAYERS - 1)
        assert torch.equal(layer[0], k) and torch.equal(layer[1], v)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_a_layer_source_asks_the_kernel_for_the_next_layers_and_reads_on_without_it(tmp_path, monkeypatch):
    e = make_entry(7, dtype=torch.bfloat16)
    store = TieredKVStore([DiskTier(tmp_path, capacity_bytes=1 << 30)])
    store.put(e)
    nbytes = e.meta.layer_nbytes
    monkeypatch.setattr(disk_module, "READ_AHEAD_BYTES", 3 * nbytes)  # three layers at most
    advised: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        advised.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(disk_module.os, "posix_fadvise", spy)
    src = open_source(store, e.key)
    assert isinstance(src, LayerwiseSource)
    base = src._reader._base
    for i in range(LAYERS):
        k, v = src.load_layer(i)
        assert torch.equal(k, e.layer(i)[0]) and torch.equal(v, e.layer(i)[1])
    src.finish()
    # from each layer's start: two layers at the first, growing to the limit, never past the last layer
    assert LAYERS == 4 and advised == [(base, 2 * nbytes), (base + nbytes, 3 * nbytes),
                                       (base + 2 * nbytes, 2 * nbytes), (base + 3 * nbytes, nbytes)]

    def failing(*_args: object) -> None:
        raise OSError(22, "not supported here")

    monkeypatch.setattr(disk_module.os, "posix_fadvise", failing)
    src = open_source(store, e.key)
    assert all(torch.equal(src.load_layer(i)[1], e.layer(i)[1]) for i in range(LAYERS))
    src.finish()


def test_an_entry_read_from_its_second_layer_on_reads_its_first_to_be_promoted(tmp_path):
    """A fused pass computes layer 0 of a disk entry instead of reading it: the source reads that layer
    when it promotes the entry, so the promoted entry is whole; one whose layer 0 then fails its
    checksum is dropped, not promoted."""
    good, bad = make_entry(7), make_entry(8)
    mem, disk = MemoryTier("cpu", "cpu", 1 << 30), DiskTier(tmp_path, 1 << 30)
    store = TieredKVStore([mem, disk])
    disk.put(good)
    disk.put(bad)
    for entry in (good, bad):
        src = open_source(store, entry.key)
        assert isinstance(src, LayerwiseSource)
        if entry is bad:  # one byte of layer 0's data, after the source has opened the file
            with open(disk.path_of(entry.key), "r+b") as f:
                f.seek(src._reader._base + 5)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        for i in range(1, LAYERS):
            assert torch.equal(src.load_layer(i)[0], entry.layer(i)[0])
        src.finish()
    assert same(mem.get(good.key), good)
    assert not mem.contains(bad.key) and not disk.contains(bad.key) and disk.stats().corrupt == 1


def test_get_or_compute_computes_only_missing(tmp_path):
    store = TieredKVStore([DiskTier(tmp_path, 1 << 30)])
    calls: list[list[list[int]]] = []

    def compute(lists):
        calls.append(lists)
        return [(torch.full((LAYERS, len(t), 2, 16), float(t[0])),) * 2 for t in lists]

    first = store.get_or_compute("m", torch.float32, [[1, 2], [3, 4, 5], [1, 2]], compute)
    again = store.get_or_compute("m", torch.float32, [[3, 4, 5], [6]], compute)
    assert calls == [[[1, 2], [3, 4, 5]], [[6]]]
    assert isinstance(first[0], StoredKV) and first[0].key == first[2].key
    assert torch.equal(again[0].kv()[0], first[1].kv()[0])


def test_memory_tier_stays_consistent_under_threads() -> None:
    """Savers (a connector's save thread, a session's async save) put while loaders get and a
    scheduler looks up, in one process: no lookup may fail mid-eviction and the byte count must
    stay that of the entries held. A tiny switch interval makes the threads interleave often."""
    entries = [make_entry(i, tokens=8) for i in range(12)]
    tier = MemoryTier("cpu", "cpu", capacity_bytes=3 * entries[0].nbytes)
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for n in range(3000):
                e = entries[(n * 5 + offset) % len(entries)]
                tier.put(e)
                tier.get(entries[(n + offset) % len(entries)].key)
                tier.contains(e.key)
                if n % 7 == offset:
                    tier.delete(e.key)
        except BaseException as exc:  # noqa: BLE001 - any failure in a worker fails the test
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    held = [e for e in entries if tier.contains(e.key)]
    assert tier.stats().bytes == sum(e.nbytes for e in held) <= tier.capacity_bytes
    assert tier.stats().entries == len(held)


@pytest.mark.gpu
def test_disk_reads_to_the_gpu_from_several_threads_each_get_their_own_entry(tmp_path) -> None:
    """Reads to a GPU go through the tier's two page-locked staging buffers; readers on other
    threads (a prefetch pool, a session's io thread) must not write into a read in progress."""
    from concurrent.futures import ThreadPoolExecutor

    disk = DiskTier(tmp_path, 1 << 30)
    try:
        entries = [make_entry(i, tokens=512) for i in range(6)]
        for e in entries:
            disk.put(e)
        with ThreadPoolExecutor(4) as pool:
            for _ in range(3):
                got = list(pool.map(lambda e: disk.get(e.key, torch.device("cuda")), entries))
                assert all(g is not None and same(g, e) for g, e in zip(got, entries))
    finally:
        disk.close()


def test_a_closed_store_lets_go_of_its_memory_tiers_entries():
    """A closed store object may outlive its use (a reference in a report, a traceback): its pools'
    entries must not live on with it."""
    import gc
    import weakref

    tier = MemoryTier("cpu", "cpu", 1 << 30, pin=False)
    store = TieredKVStore([tier])
    entry = make_entry(0)
    store.put(entry)
    held = weakref.ref(entry.layers[0])
    del entry
    gc.collect()
    assert held() is not None and tier.stats().entries == 1
    store.close()
    gc.collect()
    assert held() is None
    assert tier.stats().entries == 0 and tier.stats().bytes == 0
    assert store.get(make_entry(0).key) is None
