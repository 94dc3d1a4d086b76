"""The Redis tier against a real ``redis-server`` on loopback (CI installs it; locally it skips)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from ragfuse.bench.serve_process import free_port
from ragfuse.engine.kvstore import (
    DiskTier,
    KVStoreError,
    LayerwiseSource,
    MemoryTier,
    RedisTier,
    TieredKVStore,
    UnreadableEntryError,
)
from tests.kvstore_helpers import make_entry, same


def _start_redis() -> tuple[subprocess.Popen, str]:
    """A private ``redis-server`` on a free loopback port, and its URL, once it accepts connections."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (scripts/setup.sh installs it in CI)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def redis_url():
    proc, url = _start_redis()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def tier(redis_url, request):
    t = RedisTier(redis_url, capacity_bytes=1 << 30, prefix=f"test:{request.node.name}")
    yield t
    t.close()


def test_roundtrip_and_layer_reads(tier):
    e = make_entry(1)
    assert tier.put(e) == [] and tier.contains(e.key)
    got = tier.get(e.key)
    assert same(got, e)
    meta = tier.meta(e.key)
    assert meta.checksum == e.meta.checksum
    assert (tier.read_layer(e.key, meta, 2) == e.layers[2]).all()
    s = tier.stats()
    assert (s.hits, s.entries, s.bytes) == (1, 1, e.nbytes)


def test_lru_eviction_by_capacity(redis_url):
    e = [make_entry(i) for i in range(3)]
    tier = RedisTier(redis_url, capacity_bytes=2 * e[0].nbytes, prefix="test:lru")
    tier.put(e[0])
    tier.put(e[1])
    assert tier.get(e[0].key) is not None
    evicted = tier.put(e[2])
    assert [x.key for x in evicted] == [e[1].key] and same(evicted[0], e[1])
    assert not tier.contains(e[1].key) and tier.stats().bytes == 2 * e[0].nbytes
    assert tier.stats().evictions == 1


def test_corrupted_value_is_dropped(tier):
    e = make_entry(5)
    tier.put(e)
    raw = bytearray(tier._r.hget(tier._hkey(e.key), "L0001"))
    raw[10] ^= 0xFF
    tier._r.hset(tier._hkey(e.key), "L0001", bytes(raw))
    assert tier.get(e.key) is None
    assert tier.stats().corrupt == 1 and not tier.contains(e.key) and tier.stats().bytes == 0


def test_as_remote_tier_below_memory_and_disk(redis_url, tmp_path):
    e = [make_entry(i) for i in range(4)]
    size = e[0].nbytes
    cpu = MemoryTier("cpu", "cpu", size)
    disk = DiskTier(tmp_path, 2 * size + 8192)
    redis = RedisTier(redis_url, 1 << 30, prefix="test:stack")
    store = TieredKVStore([cpu, disk, redis])
    for x in e:
        store.put(x)
    assert store.locate(e[0].key) == "redis"  # memory -> disk -> Redis as each filled up
    got = store.get(e[0].key)
    assert same(got, e[0]) and store.locate(e[0].key) == "cpu" and redis.stats().hits == 1


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(KVStoreError, match="not reachable"):
        RedisTier(f"redis://127.0.0.1:{free_port()}/0", 1 << 20)


def test_redis_gone_mid_read_is_unreadable_not_corrupt():
    """The server stops between two layer reads of one entry: the reader says which entry could
    not be read (the fusor's caller recomputes it) and does not call it corrupt (nothing is dropped)."""
    proc, url = _start_redis()
    try:
        tier = RedisTier(url, 1 << 30)
        entry = make_entry(3)
        tier.put(entry)
        source = LayerwiseSource(TieredKVStore([tier]), tier, entry.key)
        k, _ = source.load_layer(0)
        assert (k == entry.layers[0][0]).all()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    with pytest.raises(UnreadableEntryError) as failed:
        source.load_layer(1)
    assert failed.value.key == entry.key and "could not be read" in str(failed.value)
    with pytest.raises(KVStoreError, match="failed"):
        tier.contains(entry.key)
