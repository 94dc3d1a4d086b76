"""RagStore on real files: writers at once, removal of many chunks and of the KV `ask` stored, a full disk."""

from __future__ import annotations

import resource
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from ragfuse.docstore import NewChunk
from ragfuse.rag_store import RagStore
from tests.tiny_store import add_file, open_tiny, put_kv, tiny_config, unit

REPO = Path(__file__).resolve().parents[1]


def _best(store: RagStore, axis: int) -> int:
    _, ids = store.index.search(unit(axis), 1)
    return int(ids[0])


def test_two_store_objects_writing_at_once_keep_every_chunk(tmp_path):
    """Two writers open the store, then each commits a file and saves its index: the second's index
    was loaded before the first's commit, so updating it in place would drop the first's chunk."""
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0])
    store.close()
    first, second = open_tiny(root), open_tiny(root)
    (b,) = add_file(first, "/docs/b.txt", [1])
    (c,) = add_file(second, "/docs/c.txt", [2])
    assert len(second.index) == 3 and _best(second, 1) == b
    (d,) = add_file(first, "/docs/d.txt", [3])  # the first writer, behind the second's commit now
    assert len(first.index) == 4
    first.close()
    second.close()
    store = open_tiny(root)
    assert len(store.index) == 4 and [_best(store, i) for i in (1, 2, 3)] == [b, c, d]
    store.close()


_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tests.tiny_store import add_file, open_tiny

    root, name, axis, wait_for = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    store = open_tiny(root)
    (root / f"{name}.opened").touch()
    deadline = time.monotonic() + 120
    while not wait_for.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{name}: {wait_for} never came")
        time.sleep(0.05)
    add_file(store, f"/docs/{name}.txt", [axis])
    store.close()
    (root / f"{name}.done").touch()
""")


def test_two_writer_processes_at_once_keep_every_chunk(tmp_path):
    """Two processes (as two `ragfuse ingest`): both open the store, then b commits and saves, then c."""
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0])
    store.close()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), name, str(axis), str(root / wait_for)],
                              cwd=REPO, stderr=subprocess.PIPE, text=True)
             for name, axis, wait_for in (("b", 1, "c.opened"), ("c", 2, "b.done"))]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    store = open_tiny(root)
    assert store.docs.counts()["chunks"] == 3 and len(store.index) == 3
    found = store.docs.chunks([_best(store, 1), _best(store, 2)])
    assert sorted(c.file for c in found.values()) == ["/docs/b.txt", "/docs/c.txt"]
    store.close()


def test_remove_more_chunks_than_sqlite_binds_in_one_statement(tmp_path):
    """`store rm` of files holding more chunks (each with its own KV key) than SQLite takes bound
    values in one statement (250,000 in this build)."""
    store = open_tiny(tmp_path / "store")
    n = store.docs.db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) + 1
    with store.docs._tx():  # rows written by SQLite itself: an ingest of this size would take minutes
        store.docs.db.execute(
            "WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq WHERE i + 1 < ?)"
            " INSERT INTO chunks (file, source, ord, text, token_ids, kv_key, embedding)"
            " SELECT '/corpus/' || (i % 2) || '.txt', 's', i, 't', ?, 'key-' || i, ? FROM seq",
            (n, np.int32([7]).tobytes(), unit(0).tobytes()))
        store.docs.db.executemany("INSERT INTO files VALUES (?, ?, ?, 0)",
                                  [(f"/corpus/{f}.txt", str(f), (n + 1 - f) // 2) for f in (0, 1)])
    put_kv(store, "key-3")
    store.close()
    store = open_tiny(tmp_path / "store")
    assert len(store.index) == store.docs.counts()["chunks"] == n
    assert store.remove([p for p, _ in store.docs.files()]) == (n, 1)
    assert store.docs.counts()["chunks"] == 0 and len(store.index) == 0 and store.kv.locate("key-3") is None
    store.close()


def _ask_stored(tmp_path: Path, engine) -> tuple[RagStore, Path, dict[str, str]]:
    """A store ingested without KV from a.txt, b.txt (the same text) and c.txt, after an `ask` that
    computed each retrieved chunk's KV and stored it under the chunk's computed key (none is in the
    docstore); returns the store, the docs folder and each file's chunk key."""
    from ragfuse.chunk_kv import ChunkKV
    from ragfuse.embeddings import Embedder
    from ragfuse.ingest import Ingestor
    from ragfuse.pipeline import RagPipeline
    from ragfuse.store_dir import StoreConfig

    docs = tmp_path / "docs"
    docs.mkdir()
    same = "Saltmarsh harbour was dredged in 1874 to admit larger steamers."
    (docs / "a.txt").write_text(same)
    (docs / "b.txt").write_text(same)
    (docs / "c.txt").write_text("The Danube flows through ten countries into the Black Sea.")
    embedder = Embedder()
    store = RagStore(tmp_path / "store", StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, "flat",
                                                      512, 0))
    Ingestor(store, engine, embedder, precompute_kv=False, progress=False).ingest([docs])
    pipe = RagPipeline(engine, store)
    pipe.prepare("When was Saltmarsh harbour dredged?", 3, "reuse", None)
    chunk_kv = ChunkKV.for_context(engine, store.config.chunk_kv_context, pipe.builder)
    key = {name: chunk_kv.key(c.token_ids) for name in "abc"
           for c in store.docs.chunks(store.docs.chunk_ids(str((docs / f"{name}.txt").resolve()))).values()}
    assert key["a"] == key["b"] and store.kv.locate(key["a"]) and store.kv.locate(key["c"])
    return store, docs, key


def test_rm_removes_the_kv_ask_stored_for_chunks_but_not_what_another_chunk_uses(tmp_path, engine):
    """Removing a file removes the KV `ask` stored for its chunks, unless another file's chunk has the
    same tokens (and so the same key)."""
    store, docs, key = _ask_stored(tmp_path, engine)
    assert store.remove([str((docs / "a.txt").resolve())]) == (1, 0)
    assert store.kv.locate(key["b"]) == "disk"  # b.txt's chunk still uses it
    assert store.remove([str((docs / n).resolve()) for n in ("b.txt", "c.txt")]) == (2, 2)
    assert store.kv.locate(key["b"]) is None and store.kv.locate(key["c"]) is None
    store.close()


def test_reingesting_a_changed_file_removes_the_kv_ask_stored_for_its_old_chunks(tmp_path, engine):
    """Ingest replacing a changed file forgets its old chunks' KV as `store rm` does, also the KV that
    `ask` stored for them; a chunk of the same tokens in another file keeps its KV."""
    from ragfuse.embeddings import Embedder
    from ragfuse.ingest import Ingestor

    store, docs, key = _ask_stored(tmp_path, engine)
    (docs / "a.txt").write_text("Saltmarsh harbour closed to steamers in 1921.")
    (docs / "c.txt").write_text("The Rhine rises in the Swiss Alps.")
    report = Ingestor(store, engine, Embedder(), precompute_kv=False, progress=False).ingest([docs])
    assert sorted(Path(p).name for p in report.replaced_files) == ["a.txt", "c.txt"]
    assert report.kv_removed == 1 and store.kv.locate(key["c"]) is None
    assert store.kv.locate(key["b"]) == "disk"  # b.txt's chunk, unchanged, still uses it
    store.close()


_FULL_DISK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreError
    from tests.tiny_store import add_file

    store = RagStore.open_existing(Path(sys.argv[1]))  # its index is stale: rebuilt, but cannot be saved
    print("serving", len(store.index))
    try:
        add_file(store, "/docs/late.txt", [3])
    except StoreError as exc:
        print("writer:", exc)
    print("serving", len(store.index))
    store.close()
""")


def test_an_index_that_cannot_be_saved_is_served_from_memory_and_a_writer_is_told(tmp_path):
    """A file-size limit (a full disk, for one process) below the index's size: opening a store whose
    index is stale still serves it, rebuilt in memory; a writer gets a StoreError; no temp file stays."""
    root = tmp_path / "store"
    store = RagStore(root, tiny_config(embedding_dim=256))
    vectors = np.eye(256, dtype=np.float32).repeat(8, axis=0)  # 2048 chunks: an index of 2 MiB
    chunks = [NewChunk("/docs/big.txt", "t", (i,), None, v) for i, v in enumerate(vectors)]
    store.apply_changes(*store.docs.replace_file("/docs/big.txt", "h", chunks), vectors)
    store.docs.replace_file("/docs/new.txt", "h2", [NewChunk("/docs/new.txt", "t", (1,), None, vectors[0])])
    store.close()  # committed, never indexed: as after a crash between the two
    saved = (root / "index.faiss").stat().st_mtime_ns
    limit = 256 << 10
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(root)], cwd=REPO, capture_output=True,
        text=True, timeout=300, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 0, proc.stderr
    n = len(chunks) + 1
    assert proc.stdout.splitlines()[0] == f"serving {n}"
    assert "cannot save the vector index" in proc.stderr  # the reader's warning
    writer = proc.stdout.splitlines()[1]
    assert writer.startswith("writer: cannot save the vector index") and "File too large" in writer
    assert proc.stdout.splitlines()[2] == f"serving {n + 1}"
    assert not list(root.glob("*.tmp")) and (root / "index.faiss").stat().st_mtime_ns == saved
    store = RagStore.open_existing(root)  # room again: rebuilt and saved
    assert len(store.index) == n + 1 and store.docs.counts()["chunks"] == n + 1
    store.close()



def test_a_new_store_opened_twice_at_once_keeps_the_first_recorded_settings(tmp_path, monkeypatch):
    """Two ingests starting on a new store both find no settings; the one that records them second
    must be refused if its settings differ, not overwrite them under the first one's chunks."""
    import pytest

    from ragfuse.store_dir import StoreConfig, StoreError

    root = tmp_path / "store"
    opening = RagStore._load_index

    def other_process_records_first(self: RagStore):
        tiny_config(chunk_tokens=128).save(self.root)  # the other ingest got there first
        return opening(self)

    monkeypatch.setattr(RagStore, "_load_index", other_process_records_first)
    with pytest.raises(StoreError, match="chunk_tokens: store has 128, asked 512"):
        RagStore(root, tiny_config())
    assert StoreConfig.load(root).chunk_tokens == 128
    RagStore(root, tiny_config(chunk_tokens=128)).close()  # the same settings: both go on
