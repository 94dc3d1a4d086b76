"""The Redis tier against a real ``redis-server`` on loopback (CI installs it; locally it skips)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ragfuse.bench.serve_process import free_port
from ragfuse.engine.kvstore import (
    CorruptEntryError,
    DiskTier,
    KVStoreError,
    LayerwiseSource,
    MemoryTier,
    RedisTier,
    TieredKVStore,
    UnreadableEntryError,
    open_source,
)
from tests.kvstore_helpers import make_entry, same, start_redis


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
    # a URL redis-py refuses to parse raised its ValueError: a traceback in every command taking --redis
    with pytest.raises(KVStoreError, match="bad Redis URL 'notaurl'"):
        RedisTier("notaurl", 1 << 20)


@pytest.mark.parametrize("command", [["ingest", "README.md"], ["ask", "Why?"], ["profile"]])
def test_commands_refuse_a_bad_redis_url_before_the_model_loads(command, tmp_path, capsys, monkeypatch):
    """ingest, ask and profile told an unreachable server only after loading the model (profile after
    its whole measurement), and a malformed URL with a traceback."""
    from ragfuse.cli import main
    from ragfuse.engine import llm_engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the Redis URL was checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_model)
    store = tmp_path / "store"
    store.mkdir()
    for url, why in (("notaurl", "bad Redis URL"), (f"redis://127.0.0.1:{free_port()}/0", "not reachable")):
        assert main([*command, "--store", str(store), "--redis", url]) == 2
        assert why in capsys.readouterr().err


def test_redis_gone_mid_read_is_unreadable_not_corrupt():
    """The server stops between two layer reads of one entry: the reader says which entry could
    not be read (the fusor's caller recomputes it) and does not call it corrupt (nothing is dropped)."""
    proc, url = start_redis()
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


@contextmanager
def _after_command(tier: RedisTier, n: int, action) -> Iterator[list[bool]]:
    """Run ``action`` (another tier's call, on its own connection) right after ``tier``'s ``n``-th
    command has been answered by the server: one forced interleaving of two processes sharing Redis.
    The list it yields holds True once ``action`` ran (False-y if ``tier`` sent fewer commands)."""
    client = tier._r
    send = client.execute_command
    sent, fired = 0, []

    def execute_command(*args, **options):
        nonlocal sent
        reply = send(*args, **options)
        sent += 1
        if sent == n:
            action()
            fired.append(True)
        return reply

    client.execute_command = execute_command
    try:
        yield fired
    finally:
        del client.execute_command


def _assert_counts_match_held(tier: RedisTier) -> None:
    """The byte counter and the LRU agree with the entry hashes actually in Redis."""
    hashes = [h.decode() for h in tier._r.scan_iter(match=f"{tier.prefix}:e:*")]
    held = sum(int(tier._r.hget(h, "nbytes")) for h in hashes)
    stats = tier.stats()
    assert (stats.bytes, stats.entries) == (held, len(hashes))
    assert {m.decode() for m in tier._r.zrange(tier._lru, 0, -1)} == {h.rsplit(":", 1)[1] for h in hashes}


# name: (capacity in entries, entries there before, what process A does, what process B does meanwhile)
RACES = {
    "put-vs-put": (8, [0], lambda t, e: t.put(e[1]), lambda t, e: t.put(e[1])),
    "delete-vs-delete": (8, [0, 1], lambda t, e: t.delete(e[1].key), lambda t, e: t.delete(e[1].key)),
    "delete-vs-put": (8, [0], lambda t, e: t.delete(e[1].key), lambda t, e: t.put(e[1])),
    "evict-vs-delete": (1, [0], lambda t, e: t.put(e[1]), lambda t, e: t.delete(e[0].key)),
    "evict-vs-put": (1, [0], lambda t, e: t.put(e[1]), lambda t, e: t.put(e[1])),
}


@pytest.mark.parametrize("race", list(RACES))
def test_byte_counter_survives_two_processes_racing(redis_url, race):
    """Two tiers on one server (two processes) act on the same entry; B's call is forced in after each
    of A's commands in turn. Whatever the interleaving, the byte counter and the entry count match
    the entries Redis holds: a put counts only if it created the entry, a delete only if it removed it."""
    capacity, before, a_does, b_does = RACES[race]
    entries = [make_entry(i) for i in range(2)]
    for n in itertools.count(1):
        prefix = f"test:race:{race}:{n}"
        a, b = (RedisTier(redis_url, capacity * entries[0].nbytes, prefix=prefix) for _ in range(2))
        for i in before:
            a.put(entries[i])
        with _after_command(a, n, lambda b=b: b_does(b, entries)) as fired:
            a_does(a, entries)
        _assert_counts_match_held(a)
        a.close()
        b.close()
        if not fired:
            break


@pytest.mark.parametrize("damage", ["byte", "layers"])
def test_damaged_metadata_is_corrupt_dropped_and_a_miss(tier, damage):
    """A flipped byte in an entry's metadata (not JSON any more) or a layer count that no longer
    matches it: ``meta`` raises ``CorruptEntryError`` and drops the entry, the fusor's source
    lookup is a miss (a JSONDecodeError escaped to the caller, ``ask`` crashed on it)."""
    store = TieredKVStore([tier])
    a, b = make_entry(1), make_entry(2)
    for e in (a, b):
        tier.put(e)
        raw = bytearray(tier._r.hget(tier._hkey(e.key), "meta"))
        if damage == "byte":
            raw[0] ^= 0x01  # '{' -> 'z'
        else:
            raw = raw.replace(b'"num_layers": 4', b'"num_layers": 2')
        tier._r.hset(tier._hkey(e.key), "meta", bytes(raw))
    with pytest.raises(CorruptEntryError):
        tier.meta(a.key)
    assert open_source(store, b.key) is None
    assert not tier.contains(a.key) and not tier.contains(b.key)
    assert (tier.stats().corrupt, tier.stats().bytes, tier.stats().entries) == (2, 0, 0)


@pytest.fixture(scope="module")
def small_bulk_redis_url():
    """A server taking values of at most 1 MiB (the least proto-max-bulk-len; the default is 512 MiB)."""
    proc, url = start_redis("--proto-max-bulk-len", "1mb")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_value_the_server_refuses_is_a_clear_error_before_anything_is_evicted(small_bulk_redis_url):
    """An entry whose layers are over the server's proto-max-bulk-len: the put says so, and the
    entries it would have evicted stay (it evicted them, then the upload failed with a broken pipe)."""
    small = [make_entry(i, tokens=256) for i in range(2)]  # 32 KiB layers
    big = make_entry(9, tokens=8192)  # 2 MiB layers
    tier = RedisTier(small_bulk_redis_url, capacity_bytes=big.nbytes + small[0].nbytes, prefix="test:bulk")
    for e in small:
        tier.put(e)
    with pytest.raises(KVStoreError, match="proto-max-bulk-len 1.0 MiB"):
        tier.put(big)
    assert all(tier.contains(e.key) for e in small) and not tier.contains(big.key)
    assert tier.stats().evictions == 0 and tier.stats().bytes == 2 * small[0].nbytes


def test_an_entry_a_lower_tier_refuses_goes_on_down_or_is_lost_loudly(small_bulk_redis_url, tmp_path, caplog):
    """Demotion the tier below refuses: the caller's put, stored above, succeeds; the pushed-out entry
    goes on to the next tier, and out of the last one it is lost with a warning (the caller's put
    failed although its entry was on disk, and the pushed-out entries vanished silently)."""
    olds = [make_entry(20 + i, tokens=8192) for i in range(2)]  # too large for this Redis
    disk = DiskTier(tmp_path / "a", capacity_bytes=2 * olds[0].nbytes + 4096, reserve_bytes=0)
    store = TieredKVStore([disk, RedisTier(small_bulk_redis_url, 1 << 30, prefix="test:demote")])
    for e in olds:
        store.put(e)
    new = make_entry(30, tokens=8192)
    with caplog.at_level("WARNING", logger="ragfuse.kvstore"):
        store.put(new)
    assert store.locate(new.key) == "disk" and store.locate(olds[0].key) is None
    assert f"KV entry {olds[0].key}, pushed out of the tiers above, is lost: tier redis refused it" in caplog.text

    # a full disk between memory and Redis: what memory pushes out skips it and lands in Redis
    fits = [make_entry(40 + i) for i in range(2)]
    full = DiskTier(tmp_path / "b", 1 << 30, reserve_bytes=1 << 62)
    store = TieredKVStore([MemoryTier("cpu", "cpu", fits[0].nbytes), full,
                           RedisTier(small_bulk_redis_url, 1 << 30, prefix="test:skip")])
    for e in fits:
        store.put_top(e)
    assert store.locate(fits[0].key) == "redis" and same(store.get(fits[0].key), fits[0])
    last = make_entry(50)
    store.put(last)  # its write-through, refused by the disk, persists it in Redis
    assert store.tier("redis").contains(last.key) and not full.contains(last.key)


def test_two_writers_never_take_the_same_room(redis_url):
    """Room check, eviction and creation are one script: B's put forced in after each of A's commands
    in turn never leaves the tier over capacity (it did when B came between A's check and create)."""
    entries = [make_entry(i) for i in range(3)]
    for n in itertools.count(1):
        prefix = f"test:room:{n}"
        a, b = (RedisTier(redis_url, entries[0].nbytes, prefix=prefix) for _ in range(2))
        a.put(entries[0])
        with _after_command(a, n, lambda b=b: b.put(entries[2])) as fired:
            a.put(entries[1])
        assert a.stats().bytes <= a.capacity_bytes and a.stats().entries == 1
        _assert_counts_match_held(a)
        a.close()
        b.close()
        if not fired:
            break
