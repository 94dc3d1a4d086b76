"""A store this process cannot write (a read-only mount, shipped in an image or shared to replicas) is
read as it is: search, ``ask`` and a server answer from it; what would change it is refused in one line.

The in-process tests fail every ``os.open`` for writing (``read_only_fs``: root ignores file modes)
and rely on SQLite's own read-only connections; the others mount the store read-only for real
(``unshare`` + a read-only bind mount) where the machine allows it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ragfuse.cli import main
from ragfuse.docstore import DocStore
from ragfuse.engine.kvstore import DiskTier, KVStoreError, TieredKVStore
from ragfuse.engine.read_only_sqlite import ReadOnlyDatabase
from ragfuse.engine.sessions.store import hold_sessions
from ragfuse.rag_store import RagStore
from ragfuse.store_dir import StoreError
from tests.kvstore_helpers import make_entry, same
from tests.store_helpers import DEMO, ingest_demo
from tests.tiny_store import add_file, open_tiny, put_kv, tiny_config, unit


def _last_access(root: Path) -> list[tuple[str, float]]:
    db = sqlite3.connect(root / "manifest.sqlite")
    try:
        return db.execute("SELECT key, last_access FROM entries ORDER BY key").fetchall()
    finally:
        db.close()


def _contents(root: Path) -> dict[str, str]:
    """Every file of ``root`` by its digest, but the WAL sidecars a SQLite reader makes in a folder it can write."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def _flip_last_bytes(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_read_only_disk_tier_serves_its_entries_and_writes_nothing(tmp_path, request):
    """Reads come back whole, without a last-access update (a write); a put is a KVStoreError that
    says why; an entry failing its checksum is hidden from this process, never served, and its file
    left where it is (nothing can remove it)."""
    disk = DiskTier(tmp_path, 1 << 30)
    a, b = make_entry(1), make_entry(2)
    disk.put(a)
    disk.put(b)
    damaged = disk.path_of(b.key)
    disk.close()
    before = _last_access(tmp_path)
    _flip_last_bytes(damaged)
    request.getfixturevalue("read_only_fs")  # from here on
    ro = DiskTier(tmp_path, 1 << 30, read_only=True)
    store = TieredKVStore([ro])
    assert same(store.get(a.key), a)
    assert store.get(b.key) is None and not ro.contains(b.key) and ro.stats().corrupt == 1
    assert store.get(b.key) is None and damaged.exists()  # hidden, not removed
    with pytest.raises(KVStoreError, match="is read-only"):
        store.put(make_entry(3))
    store.put(a)  # one it holds is stored already: no error (a memory tier's eviction into it is no loss)
    ro.close()
    assert _last_access(tmp_path) == before


def test_a_read_only_disk_tier_without_a_manifest_is_empty(tmp_path):
    """A store ingested without KV has no manifest; read-only, none can be made: the tier is empty."""
    ro = DiskTier(tmp_path / "kv", 1 << 30, read_only=True)
    assert ro.entry_keys() == [] and ro.get(make_entry(1).key) is None
    ro.close()
    assert not (tmp_path / "kv").exists()


def test_a_read_only_store_is_searched_and_refuses_every_change(tmp_path, request, monkeypatch):
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1], kv_key="kv-of-a")
    put_kv(store, "kv-of-a")
    put_kv(store, "kv-of-nothing")  # no chunk's: gc's to take
    store.close()
    before = _contents(root)
    request.getfixturevalue("read_only_fs")  # from here on
    ro = RagStore.open_existing(root)
    assert ro.read_only and ro.docs.counts()["chunks"] == 2
    assert ro.kv.get("kv-of-a") is not None
    _, ids = ro.current_index().search(unit(1), 1)
    assert ro.docs.chunks([int(ids[0])])[int(ids[0])].text == "chunk 1 of /docs/a.txt"
    monkeypatch.setattr("ragfuse.docstore.KV_REFS_PAGE", 1)  # read-only, the chunks are listed a page at a time
    assert sorted(ro.docs.iter_kv_refs()) == [("kv-of-a", (1,)), ("kv-of-a", (2,))]
    report = ro.gc(dry_run=True, verify=True, progress=False)  # a check of a shipped store: it only reads
    assert report.unreferenced_entries == 1 and report.verified_entries == 2 and not report.corrupt_entries
    for change in (lambda: ro.remove(["/docs/a.txt"]), ro.clear, ro.gc,
                   lambda: ro.apply_changes([], [], torch.zeros(0, 4).numpy())):
        with pytest.raises(StoreError, match="is read-only"):
            change()
    with pytest.raises(StoreError, match="an ingest would change it"), ro.ingesting():
        pass
    with pytest.raises(KVStoreError, match="sessions folder .* is read-only"):
        hold_sessions(root / "sessions")
    ro.close()
    assert _contents(root) == before


def test_a_read_only_folder_without_an_ingest_is_refused(tmp_path, request):
    (tmp_path / "store").mkdir()
    request.getfixturevalue("read_only_fs")
    with pytest.raises(StoreError, match="read-only and holds no ingest"):
        RagStore(tmp_path / "store", tiny_config())


def test_the_cli_reads_a_read_only_store_and_refuses_changes_in_a_line(tmp_path, capsys, request):
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1])
    store.close()
    request.getfixturevalue("read_only_fs")
    assert main(["store", "stats", "--store", str(root)]) == 0
    assert "1 files, 2 chunks" in capsys.readouterr().out
    assert main(["store", "gc", "--dry-run", "--store", str(root)]) == 0
    capsys.readouterr()
    for argv in (["store", "rm", "--all"], ["store", "gc"], ["store", "rm", "/docs/a.txt"]):
        assert main([*argv, "--store", str(root)]) == 2
        err = capsys.readouterr().err
        assert "is read-only" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_docstore_opened_read_only_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match="cannot open the docstore"):
        DocStore(tmp_path / "none.sqlite", read_only=True)
    assert not (tmp_path / "none.sqlite").exists()


def test_a_reader_beside_a_writer_reads_each_commit_on_one_connection(tmp_path):
    """Opened while a writer has the database open (its -shm there: ``mode=ro``), the reader takes part
    in SQLite's WAL protocol: it reads every commit as it lands, on the connection it opened, where it
    reopened at each commit before (the files' stamps change with every write)."""
    path = tmp_path / "db.sqlite"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE t (x INTEGER)")
    reader = ReadOnlyDatabase(path)
    first = reader._db
    try:
        for i in range(5):
            writer.execute("INSERT INTO t VALUES (?)", (i,))
            assert reader.execute("SELECT COUNT(*), MAX(x) FROM t").fetchone() == (i + 1, i)
        assert reader._db is first
    finally:
        reader.close()
        writer.close()


def _unshare_works(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    if shutil.which("unshare") is None:
        return False
    run = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind -o ro {probe} {probe} && ! touch {probe}/x"],
                         capture_output=True)
    return run.returncode == 0


def _in_read_only_mount(root: Path, command: str) -> list[str]:
    """``command`` (sh) run with ``root`` bind-mounted read-only in a mount namespace of its own."""
    return ["unshare", "-rm", "sh", "-c", f"mount --bind -o ro {root} {root} && {command}"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
REPO = Path(__file__).resolve().parents[1]
READER = """
import json, sys, time
from pathlib import Path
from ragfuse.rag_store import RagStore
from tests.tiny_store import unit
root, go = Path(sys.argv[1]), Path(sys.argv[2])
store = RagStore.open_existing(root)
def look():
    _, ids = store.current_index().search(unit(2), 1)
    return {"read_only": store.read_only, "files": store.docs.counts()["files"],
            "kv": store.kv.get("kv-of-b") is not None, "top": store.docs.chunks([int(ids[0])])[int(ids[0])].text}
print(json.dumps(look()), flush=True)
while not go.exists():
    time.sleep(0.05)
print(json.dumps(look()), flush=True)
"""


def test_a_read_only_reader_sees_what_a_writer_behind_the_mount_commits(tmp_path):
    """Serving replicas on a read-only bind of a store an ingest still writes: the reader opened it
    with no writer about (no -shm: SQLite's immutable mode, a snapshot that never changes); the
    writer's chunks, index and KV are then found at the reader's next search, without a restart and
    without "database disk image is malformed"."""
    if not _unshare_works(tmp_path):
        pytest.skip("this machine cannot mount a folder read-only (unshare -rm + bind mount)")
    root, go = tmp_path / "store", tmp_path / "go"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1])
    store.close()
    reader = subprocess.Popen(_in_read_only_mount(root, f"{sys.executable} -c '{READER}' {root} {go}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    try:
        before = json.loads(reader.stdout.readline() or "null")
        assert before is not None, reader.stderr.read()[-3000:]
        assert before["read_only"] and before["files"] == 1 and not before["kv"]
        writer = open_tiny(root)  # the writer, outside the mount
        add_file(writer, "/docs/b.txt", [2], kv_key="kv-of-b")
        put_kv(writer, "kv-of-b")
        writer.close()
        go.touch()
        after = json.loads(reader.stdout.readline() or "null")
        assert after is not None, reader.stderr.read()[-3000:]
    finally:
        go.touch()
        reader.wait(timeout=60)
    assert after == {"read_only": True, "files": 2, "kv": True, "top": "chunk 2 of /docs/b.txt"}


def test_changes_only_a_lost_wal_index_holds_are_an_error_not_older_data(tmp_path):
    """A docstore whose last commits sit in its WAL, with the WAL's -shm gone (a copy that skipped it,
    a writer killed and its files tidied): read-only, SQLite can only read it as it was before those
    commits. That is refused in a line, where the removed or added documents would be served wrong."""
    if not _unshare_works(tmp_path):
        pytest.skip("this machine cannot mount a folder read-only (unshare -rm + bind mount)")
    root, copy = tmp_path / "store", tmp_path / "copy"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1])  # committed into the WAL, not yet checkpointed while it is open
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("*-shm"))
    store.close()
    assert (copy / "docstore.sqlite-wal").stat().st_size > 0
    run = subprocess.run(_in_read_only_mount(copy, f"{sys.executable} -m ragfuse.cli store stats --store {copy}"),
                         capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert run.returncode == 2 and "write-ahead log" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_ask_answers_from_a_store_on_a_read_only_mount(tmp_path, engine):
    """For real: the demo store bind-mounted read-only in a mount namespace of its own. ``ask`` answers
    from the stored KV (disk tier), ``session ls`` lists the sessions a writable run kept there, and
    ``ingest`` (before its model loads) and a new ``ask --session`` are refused."""
    if not _unshare_works(tmp_path):
        pytest.skip("this machine cannot mount a folder read-only (unshare -rm + bind mount)")
    root = ingest_demo(tmp_path / "store", engine)
    ragfuse = [sys.executable, "-m", "ragfuse.cli"]
    kept = subprocess.run([*ragfuse, "ask", "Hello", "--store", str(root), "--session", "s1", "--max-tokens", "2",
                           "--recompute-ratio", "0.15"], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert kept.returncode == 0, kept.stderr[-2000:]
    script = " && ".join([
        " ".join([*ragfuse, "ask", "'Who was the last keeper of the Hollowpoint lighthouse?'", "--store", str(root),
                  "--json", "--max-tokens", "8", "--recompute-ratio", "0.15", ">", str(tmp_path / "ask.json")]),
        f"{' '.join(ragfuse)} session ls --store {root} > {tmp_path / 'sessions.txt'}",
        f"! {' '.join(ragfuse)} ingest {DEMO} --store {root} 2> {tmp_path / 'ingest.err'}",
        f"! {' '.join(ragfuse)} ask hello --store {root} --session s2 2> {tmp_path / 'session.err'}",
    ])
    run = subprocess.run(_in_read_only_mount(root, script), capture_output=True, text=True, env=ENV, cwd=REPO,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    answer = json.loads((tmp_path / "ask.json").read_text())
    assert answer["answer"].strip() and "disk" in answer["tiers"] and answer["reused_tokens"] > 0
    assert not any("stor" in note for note in answer.get("notes", [])), answer.get("notes")
    assert "s1" in (tmp_path / "sessions.txt").read_text()
    ingest_err = (tmp_path / "ingest.err").read_text()
    assert "is read-only" in ingest_err and "Loading" not in ingest_err, ingest_err
    assert "sessions folder" in (tmp_path / "session.err").read_text()


def test_a_server_on_a_read_only_store_keeps_sessions_in_memory(tmp_path, engine):
    """A replica serving a read-only store with no sessions folder of its own: it starts (it refused
    before), says that sessions live in memory only, and a session's second turn reuses the first's KV."""
    if not _unshare_works(tmp_path):
        pytest.skip("this machine cannot mount a folder read-only (unshare -rm + bind mount)")
    import httpx

    root = ingest_demo(tmp_path / "store", engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = f"{sys.executable} -m ragfuse.cli serve --store {root} --port {port} --device cpu --no-gate"
    server = subprocess.Popen(_in_read_only_mount(root, f"exec {serve}"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1][-3000:]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        turns = []
        messages = [{"role": "user", "content": "Hi, I am Ana."}]
        for follow_up in ("What is my name?", None):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 3, "session_id": "ana"})
            assert r.status_code == 200, r.text
            turns.append(r.json())
            if follow_up:
                messages += [turns[-1]["choices"][0]["message"], {"role": "user", "content": follow_up}]
        assert turns[0]["usage"]["ragfuse"]["session_tokens_reused"] == 0
        assert turns[1]["usage"]["ragfuse"]["session_tokens_reused"] > 0
    finally:
        server.terminate()
        err = server.communicate(timeout=60)[1]
    assert "sessions are kept in memory only" in err and "Traceback" not in err, err[-3000:]
    assert not (root / "sessions").exists()


def test_kv_a_read_only_store_lacks_is_computed_and_kept_in_memory(tmp_path, engine, request):
    """A chunk whose entry is gone (or never stored: an ingest with --no-kv) is computed on a read-only
    store, as anywhere; it cannot be stored, which is no fault: the answer's note says it is kept in
    memory only (it said "storing it failed"), and the next question finds it there."""
    from ragfuse.app import open_pipeline
    from ragfuse.engine import SamplingParams

    root = ingest_demo(tmp_path / "store", engine)
    for entry in (root / "kv" / "data").rglob("*.safetensors"):
        entry.unlink()
    request.getfixturevalue("read_only_fs")
    pipeline = open_pipeline(str(root), engine=engine, gate=False)
    try:
        first, second = (pipeline.ask("How tall is the Hollowpoint lighthouse?", mode="fuse", ratio=0.15, top_k=2,
                                      params=SamplingParams(max_tokens=2)) for _ in range(2))
    finally:
        pipeline.store.close()
    kept = [n for n in first.notes if "kept in memory only (the store is read-only)" in n]
    assert len(kept) >= 2 and not any("failed" in n for n in first.notes), first.notes
    assert not any("computed" in n for n in second.notes) and "cpu" in second.tiers, (second.notes, second.tiers)
