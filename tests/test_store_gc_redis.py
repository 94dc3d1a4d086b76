"""`ragfuse store gc --redis URL` against a real ``redis-server`` (CI installs it; locally it skips
without one): the store's Redis entries no chunk uses go too (counted, with their bytes, in --json,
none in --dry-run), with --verify the damaged ones; another store's entries on the same server, even
under the same keys, and keys outside any store stay."""

from __future__ import annotations

import json
from pathlib import Path

import redis
import torch

from ragfuse.cli import main
from ragfuse.engine.kvstore import RedisTier, StoredKV
from ragfuse.rag_store import RagStore
from tests.tiny_store import add_file, put_kv, tiny_config


def _open(root: Path, url: str) -> RagStore:
    return RagStore(root, tiny_config(), redis_url=url)


def _redis(store: RagStore) -> RedisTier:
    return store.kv.tier("redis")  # type: ignore[return-value]


def _put_redis(store: RagStore, *keys: str) -> list[StoredKV]:
    """Entries under ``keys`` in the store's Redis tier (where the disk tier demotes them to)."""
    entries = [StoredKV.from_kv(key, torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)) for key in keys]
    for e in entries:
        assert _redis(store).put(e) == []
    return entries


def _gc(capsys, root: Path, *options: str) -> dict:
    capsys.readouterr()
    assert main(["store", "gc", "--store", str(root), "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def test_gc_removes_the_stores_unused_redis_entries_and_nothing_of_other_stores(tmp_path, redis_url, capsys):
    a = _open(tmp_path / "a", redis_url)
    add_file(a, "/docs/used.txt", [0], kv_key="kv-used")
    used, unused, also_unused = _put_redis(a, "kv-used", "kv-unused", "kv-also-unused")
    put_kv(a, "kv-disk-unused")
    a.close()
    # another store on the same server: its entries are no chunk's of store a, one under the same key
    b = _open(tmp_path / "b", redis_url)
    add_file(b, "/other/b.txt", [1], kv_key="kv-b")
    _put_redis(b, "kv-b", "kv-unused")
    b.close()
    raw = redis.Redis.from_url(redis_url)
    raw.set("someone-else:key", b"kept")

    plain = _gc(capsys, tmp_path / "a")
    assert plain["unreferenced_entries"] == 1 and plain["redis"] is None  # the disk alone without --redis
    a = _open(tmp_path / "a", redis_url)
    assert _redis(a).entry_sizes() == {e.key: e.nbytes for e in (used, unused, also_unused)}
    a.close()

    dry = _gc(capsys, tmp_path / "a", "--redis", redis_url, "--dry-run")
    assert dry["redis"]["unreferenced_entries"] == 2
    assert dry["redis"]["unreferenced_bytes"] == unused.nbytes + also_unused.nbytes > 0
    assert dry["unreferenced_entries"] == 0 and dry["bytes"] == dry["redis"]["unreferenced_bytes"]
    a = _open(tmp_path / "a", redis_url)
    assert len(_redis(a).entry_sizes()) == 3  # a dry run removes nothing
    a.close()

    done = _gc(capsys, tmp_path / "a", "--redis", redis_url)
    assert done["redis"]["unreferenced_entries"] == 2 and done["redis"]["unreferenced_bytes"] == dry["redis"][
        "unreferenced_bytes"]
    a = _open(tmp_path / "a", redis_url)
    assert _redis(a).entry_sizes() == {"kv-used": used.nbytes}
    assert _redis(a).stats().bytes == used.nbytes  # the tier's byte counter gave the removed ones back
    assert a.kv.get("kv-used") is not None
    a.close()
    b = _open(tmp_path / "b", redis_url)
    assert set(_redis(b).entry_sizes()) == {"kv-b", "kv-unused"}
    b.close()
    assert raw.get("someone-else:key") == b"kept"
    assert _gc(capsys, tmp_path / "a", "--redis", redis_url)["redis"]["unreferenced_entries"] == 0


def test_verify_drops_a_damaged_redis_entry_and_a_dry_run_only_reports_it(tmp_path, redis_url, capsys):
    a = _open(tmp_path / "a", redis_url)
    add_file(a, "/docs/x.txt", [0, 1], kv_key=None)
    add_file(a, "/docs/good.txt", [2], kv_key="kv-good")
    add_file(a, "/docs/bad.txt", [3], kv_key="kv-bad")
    good, bad = _put_redis(a, "kv-good", "kv-bad")
    tier = _redis(a)
    raw = redis.Redis.from_url(redis_url)
    layer = bytearray(raw.hget(f"{tier.prefix}:e:kv-bad", "L0001"))
    layer[5] ^= 0xFF  # one flipped byte of a stored layer
    raw.hset(f"{tier.prefix}:e:kv-bad", "L0001", bytes(layer))
    a.close()

    assert _gc(capsys, tmp_path / "a", "--redis", redis_url)["redis"]["corrupt_entries"] == []  # not read without
    dry = _gc(capsys, tmp_path / "a", "--redis", redis_url, "--verify", "--dry-run")["redis"]
    assert (dry["corrupt_entries"], dry["corrupt_bytes"], dry["verified_entries"]) == (["kv-bad"], bad.nbytes, 2)
    assert dry["unreferenced_entries"] == 0  # referenced, but damaged
    assert raw.exists(f"{tier.prefix}:e:kv-bad")

    done = _gc(capsys, tmp_path / "a", "--redis", redis_url, "--verify")["redis"]
    assert done["corrupt_entries"] == ["kv-bad"] and done["corrupt_bytes"] == bad.nbytes
    a = _open(tmp_path / "a", redis_url)
    assert _redis(a).entry_sizes() == {"kv-good": good.nbytes}
    a.close()
    assert _gc(capsys, tmp_path / "a", "--redis", redis_url, "--verify")["redis"]["corrupt_entries"] == []


def test_a_store_keeps_its_redis_namespace_when_reopened_or_moved(tmp_path, redis_url):
    a = _open(tmp_path / "a", redis_url)
    prefix = _redis(a).prefix
    a.close()
    (tmp_path / "a").rename(tmp_path / "moved")
    moved = _open(tmp_path / "moved", redis_url)
    other = _open(tmp_path / "b", redis_url)
    assert _redis(moved).prefix == prefix != _redis(other).prefix
    moved.close()
    other.close()


def test_a_copied_store_gets_a_redis_namespace_of_its_own(tmp_path, redis_url):
    """`cp -a` of a store copied its namespace id, and the copy's gc removed the original's entries
    (unused by the copy's chunks). The recorded file names its inode: a copy's file is a new one."""
    import shutil

    a = _open(tmp_path / "a", redis_url)
    prefix = _redis(a).prefix
    a.close()
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    copy = _open(tmp_path / "copy", redis_url)
    assert _redis(copy).prefix != prefix
    copy_prefix = _redis(copy).prefix
    copy.close()
    again = _open(tmp_path / "copy", redis_url)  # its own id, kept from now on
    a = _open(tmp_path / "a", redis_url)
    assert _redis(again).prefix == copy_prefix and _redis(a).prefix == prefix
    again.close()
    a.close()
    legacy = tmp_path / "legacy"  # a file written before the inode was recorded keeps its id
    shutil.copytree(tmp_path / "a", legacy)
    (legacy / "redis_namespace").write_text("0123abcd")
    old = _open(legacy, redis_url)
    assert _redis(old).prefix == "ragfuse:kv:0123abcd"
    old.close()
