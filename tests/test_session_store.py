"""The session store without a model: background saves, checksummed disk copies, look-ahead prefetch."""

from __future__ import annotations

import torch

from ragfuse.engine.sessions import SessionStore, Snapshot

LAYERS, HEADS, DIM = 2, 2, 8


def snapshot(tokens: int, seed: int) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    return Snapshot(torch.randn(LAYERS, 2, tokens, HEADS, DIM, generator=g), None)


def test_queued_session_is_prefetched_from_disk_into_memory(tmp_path) -> None:
    one = LAYERS * 2 * 10 * HEADS * DIM * 4  # bytes of a 10-token session
    store = SessionStore(tmp_path, "fp", torch.float32, cpu_bytes=one, disk_bytes=10 * one)
    for i, sid in enumerate(["a", "b"]):
        store.save(sid, list(range(11)), [(0, 10)], snapshot(10, i))
        store.flush()
    assert store.tier_of("a") == "disk" and store.tier_of("b") == "cpu"  # memory holds one session
    store.hint(["a"])
    store.flush()
    assert store.tier_of("a") == "cpu" and store.tier_of("b") == "disk"
    look = store.lookup("a")
    assert look.tier == "cpu" and look.record.tokens == list(range(11))
    k, v = look.open_source(10, None).load_layer(1)
    assert torch.equal(k, snapshot(10, 0).layers[1, 0]) and torch.equal(v, snapshot(10, 0).layers[1, 1])
    assert store.stats()["prefetches"] == 1
    store.close()


def test_ttl_expires_idle_sessions(tmp_path) -> None:
    now = [0.0]
    store = SessionStore(tmp_path, "fp", torch.float32, ttl_s=60, clock=lambda: now[0])
    store.save("old", [1, 2, 3], [(0, 2)], snapshot(2, 0))
    store.flush()
    now[0] = 61.0
    look = store.lookup("old")
    assert look.record is None and "expired" in look.reason
    store.close()


def test_sessions_are_listed_and_deleted_with_their_files(tmp_path) -> None:
    now = [100.0]
    store = SessionStore(tmp_path, "fp", torch.float32, clock=lambda: now[0])
    store.save("a", list(range(7)), [(0, 6)], snapshot(6, 0))
    store.flush()
    now[0] = 200.0
    store.save("b", list(range(5)), [(0, 4)], snapshot(4, 1))  # listed at once: the save is waited for
    listed = store.sessions()
    assert [(s.session_id, s.tokens, s.stored_rows, s.tier) for s in listed] == [("b", 5, 4, "cpu"),
                                                                                   ("a", 7, 6, "cpu")]
    assert listed[0].last_access == 200.0 and listed[1].nbytes == LAYERS * 2 * 6 * HEADS * DIM * 4
    store.flush()
    assert (tmp_path / "records" / "a.json").exists()
    assert store.delete("a") and not store.delete("a") and not store.delete("never")
    store.flush()
    assert [s.session_id for s in store.sessions()] == ["b"] and not (tmp_path / "records" / "a.json").exists()
    look = store.lookup("a")
    assert look.record is None and look.reason == ""  # a deleted id is simply new, not "lost"
    store.close()
    reopened = SessionStore(tmp_path, "fp", torch.float32)  # what survives the process
    assert [(s.session_id, s.tier) for s in reopened.sessions()] == [("b", "disk")]
    reopened.close()


def test_a_disk_with_no_room_costs_sessions_not_errors(tmp_path) -> None:
    """Memory holds one session and the disk (the tier's real free-space check, its reserve raised)
    takes none: the session memory holds stays usable without its disk copy, the one pushed out of
    memory is gone with a reason (its next turn recomputes the history), and nothing raises: not a
    lookup, not flush or close (the failed write used to resurface at each of them)."""
    one = LAYERS * 2 * 10 * HEADS * DIM * 4
    store = SessionStore(tmp_path, "fp", torch.float32, cpu_bytes=one, disk_bytes=10 * one)
    assert store.disk is not None
    store.disk.reserve_bytes = 1 << 62
    for i, sid in enumerate(["a", "b"]):
        store.save(sid, list(range(11)), [(0, 10)], snapshot(10, i))
        store.flush()
    look = store.lookup("a")
    assert look.record is None and look.reason.startswith("session a ")
    assert store.conversation("a") == []
    kept = store.lookup("b")
    assert kept.tier == "cpu" and kept.record.tokens == list(range(11))
    k, _ = kept.open_source(10, None).load_layer(1)
    assert torch.equal(k, snapshot(10, 1).layers[1, 0])
    assert store.disk.entry_keys() == [] and store.stats()["disk_bytes"] == 0
    store.close()
