"""The host buffer pool the disk tier reads into: reuse only once nobody holds the memory."""

from __future__ import annotations

import gc
import os

import torch

from ragfuse.engine.kvstore import DiskTier, MemoryTier, TieredKVStore
from ragfuse.engine.kvstore.buffer_pool import HostBufferPool
from tests.kvstore_helpers import make_entry, same


def test_buffer_is_reused_only_after_every_tensor_over_it_is_gone():
    pool = HostBufferPool(max_idle_bytes=1 << 20)
    t = pool.take(4096)
    ptr = t.data_ptr()
    view = t[100:].view(torch.int32)  # a view keeps the memory alive after the tensor is gone
    del t
    gc.collect()
    other = pool.take(4096)
    assert other.data_ptr() != ptr and pool.stats.reused == 0
    del view
    assert pool.idle_bytes == 4096
    again = pool.take(4096)
    assert again.data_ptr() == ptr and pool.stats.reused == 1 and pool.idle_bytes == 0
    assert pool.take(2048).data_ptr() not in (ptr, other.data_ptr())  # sizes are not mixed


def test_idle_limit_gives_extra_buffers_back():
    pool = HostBufferPool(max_idle_bytes=3000)
    bufs = [pool.take(1000) for _ in range(4)]
    del bufs
    assert pool.idle_bytes == 3000 and pool.stats.dropped == 1
    pool.clear()
    assert pool.idle_bytes == 0
    off = HostBufferPool(max_idle_bytes=0)
    t = off.take(1000)
    del t
    assert off.idle_bytes == 0 and off.take(1000).numel() == 1000


def test_disk_reads_reuse_buffers_without_touching_live_entries(tmp_path):
    pool = HostBufferPool(max_idle_bytes=1 << 30)
    disk = DiskTier(tmp_path, 1 << 30, read_pool=pool)
    e = [make_entry(i, dtype=torch.bfloat16) for i in range(3)]
    for x in e:
        disk.put(x)
    kept = disk.get(e[0].key)  # held by the caller: its buffer must not be handed out again
    dropped = disk.get(e[1].key)
    freed_ptr = dropped.layers[0].data_ptr()
    del dropped
    third = disk.get(e[2].key)
    assert third.layers[0].data_ptr() == freed_ptr and pool.stats.reused == 1
    again = disk.get(e[1].key)  # needs a fresh buffer: the other two are in use
    assert again.layers[0].data_ptr() not in (freed_ptr, kept.layers[0].data_ptr())
    assert same(kept, e[0]) and same(third, e[2]) and same(again, e[1])


def test_promoted_entry_keeps_its_buffer(tmp_path):
    pool = HostBufferPool(max_idle_bytes=1 << 30)
    e = [make_entry(i) for i in range(2)]
    cpu = MemoryTier("cpu", "cpu", capacity_bytes=10 * e[0].nbytes, pin=False)
    disk = DiskTier(tmp_path, 1 << 30, read_pool=pool)
    for x in e:
        disk.put(x)
    store = TieredKVStore([cpu, disk])
    ptr = store.get(e[0].key).layers[0].data_ptr()  # promoted: the CPU tier now holds the disk read's buffer
    assert cpu.contains(e[0].key)
    assert store.tier("disk").get(e[1].key).layers[0].data_ptr() != ptr
    assert same(cpu.get(e[0].key), e[0])


def test_stale_bytes_in_a_reused_buffer_are_never_served(tmp_path):
    """A recycled buffer still holds the entry's valid bytes from an earlier read: a corrupt file
    read into it must still fail its checksum, not pass on what the buffer held before."""
    pool = HostBufferPool(max_idle_bytes=1 << 30)
    disk = DiskTier(tmp_path, 1 << 30, read_pool=pool)
    e = make_entry(5)
    disk.put(e)
    assert same(disk.get(e.key), e)  # dropped at once: its buffer, holding e's bytes, goes back
    assert pool.idle_bytes == e.nbytes
    path = disk.path_of(e.key)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert disk.get(e.key) is None
    assert pool.stats.reused == 1 and disk.stats().corrupt == 1 and not disk.contains(e.key)
