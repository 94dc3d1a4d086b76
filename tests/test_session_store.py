"""The session store without a model: background saves, checksummed disk copies, look-ahead prefetch,
and its faults: deletion during a turn, damaged KV files and records, failed writes, session ids."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from pydantic import ValidationError

from ragfuse.connectors.server.schemas import ChatCompletionRequest, RagQueryRequest
from ragfuse.engine.errors import RequestError
from ragfuse.engine.sessions import SessionStore, Snapshot, begin_turn, check_session_id
from ragfuse.engine.sessions.store import ORPHAN_GRACE_S, session_key

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


def test_a_session_being_read_by_a_turn_is_neither_evicted_nor_expired(tmp_path) -> None:
    """While a turn reads a session's KV (its source open, the read buffer waiting in the queue
    included), admitting another session must evict some other one, and the TTL must not take it:
    the turn still holds that memory, so evicting it would free nothing. Once read, it is fair game."""
    one = LAYERS * 2 * 10 * HEADS * DIM * 4  # bytes of a 10-token session
    now = [0.0]
    store = SessionStore(tmp_path, "fp", torch.float32, cpu_bytes=2 * one, disk_bytes=10 * one, ttl_s=60,
                         clock=lambda: now[0])
    store.save("reading", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.flush()
    now[0] = 1.0
    store.save("idle", list(range(11)), [(0, 10)], snapshot(10, 1))
    store.flush()
    source = store.lookup("reading").open_source(10, None)  # "reading" is now the most recent too
    now[0] = 2.0
    store.save("idle", list(range(12)), [(0, 11)], snapshot(11, 2))  # the newest: room for it needed
    store.flush()
    assert store.tier_of("reading") == "cpu"
    now[0] = 100.0  # both idle past the TTL by the clock
    assert store.lookup("reading").record is not None
    source.finish()
    source.finish()  # a turn's close runs twice on its failure path: unmarked once
    now[0] = 200.0
    assert store.lookup("reading").record is None
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


def test_a_turn_running_when_its_session_is_deleted_is_not_saved(tmp_path) -> None:
    """DELETE while a turn of the session runs: that turn's save, which comes later, is dropped, so the
    deleted conversation does not come back (memory, disk, listing). A turn begun after the deletion
    starts afresh and is saved, even when the older turn saves after it; a deletion during a session's
    very first turn (nothing stored yet) is a deletion too."""
    store = SessionStore(tmp_path, "fp", torch.float32)
    first = list(range(11))
    store.save("d", first, [(0, 10)], snapshot(10, 0))
    running = begin_turn(store, "d", [*first, 50, 51], 100, 4, 2, 0)
    assert running.reused == 10
    assert store.delete("d")
    fresh = begin_turn(store, "d", [7, 8, 9], 100, 4, 3, 0)
    assert fresh.reused == 0 and fresh.notes == []  # deleted on purpose: nothing to explain
    store.save("d", [7, 8, 9, 10], [(0, 3)], snapshot(3, 1))
    store.save("d", [*first, 50, 51, 60], [(0, 13)], snapshot(13, 2))  # the running turn ends last
    store.flush()
    assert [(s.session_id, s.tokens) for s in store.sessions()] == [("d", 4)]
    assert store.conversation("d") == [7, 8, 9, 10]
    assert store.disk.entry_keys() == [session_key("fp", torch.float32, "d", [7, 8, 9, 10])]

    only = begin_turn(store, "e", [1, 2], 100, 4, 2, 0)
    assert only.reused == 0 and store.delete("e") and not store.delete("e")
    store.save("e", [1, 2, 3], [(0, 2)], snapshot(2, 3))
    store.flush()
    assert [s.session_id for s in store.sessions()] == ["d"] and not (tmp_path / "records" / "e.json").exists()
    store.close()


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_an_unreadable_session_file_is_recomputed_with_a_note(tmp_path, damage: str) -> None:
    """A session KV file cut short (a half-written copy) or with a damaged header cannot be opened:
    the turn is planned without the stored KV (the whole conversation fed), says why, and the session
    is dropped; opening it used to raise out of the turn's planning, so the request failed."""
    store = SessionStore(tmp_path, "fp", torch.float32, cpu_bytes=0)  # disk only
    store.save("s", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.flush()
    path = store.disk.path_of(session_key("fp", torch.float32, "s", list(range(11))))
    data = path.read_bytes()
    path.write_bytes(data[:20] if damage == "truncated" else b"\xff" * 8 + data[8:])
    turn = begin_turn(store, "s", [*range(11), 20, 21], 100, 4, 2, 0)
    assert turn.source is None and turn.reused == 0 and turn.tier is None and turn.plan.ranges == [(0, 13)]
    assert [n for n in turn.notes if "not readable on disk" in n and "recomputed" in n]
    store.flush()
    assert store.tier_of("s") is None and store.disk.entry_keys() == []
    assert not (tmp_path / "records" / "s.json").exists()
    store.close()


@pytest.mark.parametrize("damage", ["ranges", "tokens", "past the tokens", "rows and ranges", "prefetched"])
def test_a_damaged_record_is_dropped_never_served(tmp_path, caplog, damage: str) -> None:
    """A record file (beside the checksummed KV, itself unchecked) with a flipped bit: its ranges
    shifted (the rows would be served at the wrong positions), a token changed (the KV paired with
    other tokens), ranges past its tokens, or ranges and row count changed alike (then the KV file,
    whose rows differ, gives it away when opened, or when prefetched into memory). The session is
    dropped with a log line and its next turn recomputes, with a note; it used to be served as is."""
    store = SessionStore(tmp_path, "fp", torch.float32)
    store.save("x", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.close()
    path = tmp_path / "records" / "x.json"
    rec = json.loads(path.read_text())
    if damage == "ranges":
        rec["ranges"] = [[1, 10]]
    elif damage == "tokens":
        rec["tokens"][5] ^= 1
    elif damage == "past the tokens":
        rec["ranges"] = [[0, 10], [10, 12]]
    else:
        rec["ranges"], rec["num_rows"] = [[0, 9]], 9
    path.write_text(json.dumps(rec))
    with caplog.at_level(logging.INFO, logger="ragfuse.sessions"):
        store = SessionStore(tmp_path, "fp", torch.float32)
        if damage == "prefetched":
            store.hint(["x"])
            store.flush()
        turn = begin_turn(store, "x", [*range(11), 20], 100, 4, 1, 0)
    assert turn.source is None and turn.reused == 0 and turn.plan.ranges == [(0, 12)]
    assert [n for n in turn.notes if n.startswith("session x ") and n.endswith("history recomputed")]
    assert [r for r in caplog.records if "x" in r.getMessage() and r.levelno >= logging.INFO]
    store.flush()
    assert not path.exists() and store.sessions() == []
    # a caller whose history was the record (a RAG session keeps no transcript) is told it is lost
    (note,) = begin_turn(store, "x", [20], 100, 4, 1, 0).notes
    assert note.startswith("session x ") and note.endswith(": its history is lost, the conversation starts afresh")
    store.close()


def test_a_record_whose_kv_file_is_gone_keeps_its_history_for_a_recompute(tmp_path) -> None:
    """The record's tokens are the whole history a RAG session has: a lost KV file costs a recompute
    of it (said in the turn's notes), not the conversation; a listing shows no stored KV for it."""
    store = SessionStore(tmp_path, "fp", torch.float32)
    store.save("x", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.flush()
    path = store.disk.path_of(store._records["x"].key)
    store.close()
    path.unlink()
    store = SessionStore(tmp_path, "fp", torch.float32)
    assert store.conversation("x") == list(range(11))
    # the listing says so before the next turn finds out: tokens kept, nothing stored, not held
    (listed,) = store.sessions()
    assert (listed.tokens, listed.stored_rows, listed.nbytes, listed.tier) == (11, 0, 0, None)
    turn = begin_turn(store, "x", [*range(11), 20], 100, 4, 1, 0)
    assert turn.source is None and turn.plan.ranges == [(0, 12)]
    assert [n for n in turn.notes if n.startswith("session x ") and n.endswith("history recomputed")], turn.notes
    store.close()


def test_a_record_that_cannot_be_written_takes_its_kv_file_with_it(tmp_path) -> None:
    """The KV file is written, then the record fails (here: a directory where the record goes, so
    the rename onto it fails as a full disk would fail it): the KV file, which no record will ever
    refer to, is deleted at once; memory keeps the session. It used to stay on disk for good."""
    store = SessionStore(tmp_path, "fp", torch.float32)
    (tmp_path / "records" / "s.json" / "in-the-way").mkdir(parents=True)
    store.save("s", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.flush()
    assert store.disk.entry_keys() == [] and store.tier_of("s") == "cpu"
    assert store.lookup("s").record.tokens == list(range(11))
    store.close()


def test_opening_the_store_removes_old_kv_files_without_a_record(tmp_path) -> None:
    """KV files whose record never came (the process died between the two writes) are removed when the
    store is next opened, once older than ORPHAN_GRACE_S: a younger one may be another process's save
    under way (its record about to be written), and is kept."""
    store = SessionStore(tmp_path, "fp", torch.float32)
    for i, sid in enumerate(["a", "b", "c"]):
        store.save(sid, list(range(11)), [(0, 10)], snapshot(10, i))
    store.flush()
    key = {sid: session_key("fp", torch.float32, sid, list(range(11))) for sid in "abc"}
    old = time.time() - ORPHAN_GRACE_S - 60
    os.utime(store.disk.path_of(key["b"]), (old, old))
    store.close()
    for sid in "bc":
        (tmp_path / "records" / f"{sid}.json").unlink()
    reopened = SessionStore(tmp_path, "fp", torch.float32)
    assert sorted(reopened.disk.entry_keys()) == sorted([key["a"], key["c"]])
    assert [s.session_id for s in reopened.sessions()] == ["a"]
    reopened.close()


def test_session_ids_are_checked_whole_and_alike_everywhere() -> None:
    """One rule for the store, the CLI and the server: the whole id must match ("a\\n" passed the
    store's check, which allowed a newline before its end), and an id the CLI may use ("ana@x") is
    one the server's chat and RAG requests take, so the session can go on over HTTP."""
    for bad in ["a\n", "", "a/b", "a b", "x" * 129]:
        with pytest.raises(RequestError):
            check_session_id(bad)
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], session_id=bad)
    for good in ["ana@x", "a.b:c-d_e", "x" * 128]:
        assert check_session_id(good) == good
        assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                     session_id=good).session_id == good
        assert RagQueryRequest(question="q", session_id=good).session_id == good


def test_a_turn_with_history_but_no_stored_session_says_so(tmp_path) -> None:
    """Sessions kept in memory only are gone after a restart without a trace: the next turn, which
    brings its history, recomputed it with no note, as if nothing had been lost. A first turn (no
    history) has nothing to say."""
    store = SessionStore(None, "fp", torch.float32)
    first = begin_turn(store, "fresh", list(range(8)), 100, 4, 8, 0)
    assert first.notes == []
    later = begin_turn(store, "lost", [*range(11), 20], 100, 4, 1, 0)
    assert later.reused == 0 and later.plan.ranges == [(0, 12)]
    assert later.notes == ["session lost has no stored KV here (new to this store, deleted, or not kept across a "
                           "restart): history computed"]
    store.close()


def test_one_process_at_a_time_keeps_a_folders_sessions(tmp_path, capsys) -> None:
    """Each process works from its own memory of the sessions: a second one saving into the same
    folder (another server, an ``ask --session`` beside a server) lost turns, and a session deleted
    beside the process serving it came back. A second holder is refused, naming the first's pid; a
    listing may look on; a delete is refused while the folder is held."""
    import os

    from ragfuse.cli import main
    from ragfuse.engine.folder_lock import FolderBusyError

    store = SessionStore(tmp_path, "fp", torch.float32)
    store.save("x", list(range(11)), [(0, 10)], snapshot(10, 0))
    store.flush()
    with pytest.raises(FolderBusyError, match=f"in use by another process \\(pid {os.getpid()}"):
        SessionStore(tmp_path, "fp", torch.float32)
    look = SessionStore.browse(tmp_path)
    assert [s.session_id for s in look.sessions()] == ["x"]
    look.close()
    assert main(["session", "rm", "x", "--session-dir", str(tmp_path)]) == 2
    assert "in use by another process" in capsys.readouterr().err
    assert store.conversation("x") == list(range(11))  # nothing was deleted under the holder
    store.close()
    assert main(["session", "rm", "x", "--session-dir", str(tmp_path)]) == 0  # released: deleted now
    again = SessionStore(tmp_path, "fp", torch.float32)
    assert again.sessions() == []
    again.close()
