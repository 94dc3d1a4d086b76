"""`ragfuse store gc` on a store a real ingest built (the demo documents, the default model): KV no chunk
uses and what crashed writers left go, with --verify damaged KV too; what a chunk uses stays, and `ask`
still reuses it; --dry-run removes nothing; an ingest running in between is never robbed of its KV."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from filelock import FileLock

from ragfuse.cli import main
from ragfuse.docstore import DocStore
from ragfuse.engine.kvstore import kv_key
from ragfuse.prompt import RagPromptBuilder
from ragfuse.rag_store import DEAD_TEMP_AGE_S, RagStore
from ragfuse.store_dir import StoreError
from tests.kvstore_helpers import make_entry
from tests.store_helpers import ingest_demo
from tests.tiny_store import add_file, open_tiny, put_kv, tiny_config

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "When was the Hollowpoint lighthouse electrified?"


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory, engine):
    return ingest_demo(tmp_path_factory.mktemp("demo") / "store", engine)


@pytest.fixture
def store_copy(tmp_path, demo_store):
    root = tmp_path / "store"
    shutil.copytree(demo_store, root)
    return root


def _gc(capsys, root: Path, *options: str) -> dict:
    capsys.readouterr()
    assert main(["store", "gc", "--store", str(root), "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith((".lock", "-wal", "-shm")))


def _keys_of(root: Path, path: str) -> set[str]:
    docs = DocStore(root / "docstore.sqlite")
    try:
        return {c.kv_key for c in docs.chunks(docs.chunk_ids(path)).values()}
    finally:
        docs.close()


def test_gc_removes_kv_of_chunks_removed_without_it_and_ask_still_reuses_the_rest(store_copy, capsys, engine):
    root = store_copy
    docs = DocStore(root / "docstore.sqlite")
    files = [p for p, _ in docs.files()]
    docs.close()
    bakery = next(f for f in files if f.endswith("bakery.txt"))
    orphans = _keys_of(root, bakery)
    kept = set().union(*(_keys_of(root, f) for f in files if f != bakery))
    # what `store rm` commits before it forgets the chunks' KV: a process killed right there leaves the KV
    docs = DocStore(root / "docstore.sqlite")
    docs.remove_files([bakery])
    docs.close()

    before = _files(root)
    dry = _gc(capsys, root, "--dry-run")
    assert dry["dry_run"] and dry["unreferenced_entries"] == len(orphans) > 0 and dry["unreferenced_bytes"] > 0
    assert _files(root) == before  # nothing removed

    done = _gc(capsys, root)
    assert not done["dry_run"] and done["unreferenced_entries"] == len(orphans)
    assert done["unreferenced_bytes"] == dry["unreferenced_bytes"] and done["leftover_files"] == []
    store = RagStore.open_existing(root)
    assert all(store.kv.locate(k) is None for k in orphans)
    assert all(store.kv.locate(k) == "disk" for k in kept)
    store.close()

    capsys.readouterr()
    assert main(["ask", QUESTION, "--store", str(root), "--json", "--top-k", "2", "--recompute-ratio", "0.3",
                 "--max-tokens", "4", "--device", "cpu"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {s["source"] for s in answer["sources"]} and all("bakery" not in s["source"] for s in answer["sources"])
    assert "disk" in answer["tiers"] and "computed" not in answer["tiers"], answer  # read from the store
    # the instruction prefix's KV too: ingest stored it with the chunks, and gc kept it (every question uses it)
    assert answer["notes"] == []
    prefix_key = kv_key(engine.fingerprint, engine.dtype, RagPromptBuilder(engine.tokenizer).prefix)
    entries = _files(root / "kv" / "data")
    assert len(entries) == len(kept) + 1 and prefix_key not in kept
    store = RagStore.open_existing(root)
    assert store.kv.locate(prefix_key) == "disk"
    store.close()
    assert _gc(capsys, root)["unreferenced_entries"] == 0 and _files(root / "kv" / "data") == entries


KILLED_WRITER = """
    import sys
    from ragfuse.engine.kvstore import DiskTier
    from tests.kvstore_helpers import make_entry
    disk = DiskTier(sys.argv[1], capacity_bytes=1 << 40)
    print("open", flush=True)
    sys.stdin.readline()
    disk.put(make_entry(7))
"""


def test_gc_removes_what_a_killed_writer_left_and_keeps_a_live_writers_temp_file(store_copy, capsys):
    root = store_copy
    kv = root / "kv"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(kv)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "open"
        # killed between writing its temp file and renaming it in: the lock the rename waits for is held here
        with FileLock(str(kv / ".lock")):
            proc.stdin.write("put\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 120
            while not list(kv.glob("data/*/.*.tmp")):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        proc.kill()
        proc.wait()
    (dead,) = kv.glob("data/*/.*.tmp")
    assert make_entry(7).key in dead.name and str(proc.pid) in dead.name
    # a live writer's temp file (this process's pid), fresh: kept; the same, untouched for longer than
    # any put takes (its pid since reused by a live process): removed
    live = dead.with_name(f".{'a' * 64}.{os.getpid()}.0123abcd.tmp")
    live.write_bytes(b"half an entry")
    reused = dead.with_name(f".{'b' * 64}.{os.getpid()}.4567cdef.tmp")
    reused.write_bytes(b"half an entry")
    # a `write_atomic` of store.json killed before its rename (mkstemp's name), old; and a fresh one
    old_settings = root / ".store.json.k3j2h1g0.tmp"
    old_settings.write_text("{")
    fresh_settings = root / ".store.json.z9y8x7w6.tmp"
    fresh_settings.write_text("{")
    # a server's upload killed before its rename (the uploads folder was not swept)
    (root / "uploads").mkdir(exist_ok=True)
    old_upload = root / "uploads" / ".notes.md.a1b2c3d4.tmp"
    old_upload.write_text("half an upload")
    long_ago = time.time() - DEAD_TEMP_AGE_S - 60
    for path in (reused, old_settings, old_upload):
        os.utime(path, (long_ago, long_ago))
    # an entry renamed in by a writer killed before listing it
    unlisted = dead.parent / f"{'c' * 64}.safetensors"
    unlisted.write_bytes(b"\0" * 100)

    leftovers = (dead, reused, old_settings, old_upload, unlisted)
    expected = {str(p.relative_to(root)) for p in leftovers}
    nbytes = sum(p.stat().st_size for p in leftovers)
    dry = _gc(capsys, root, "--dry-run")
    assert set(dry["leftover_files"]) == expected and dry["leftover_bytes"] == nbytes
    assert dry["unreferenced_entries"] == 0 and all(p.exists() for p in leftovers)
    out = _gc(capsys, root)
    assert set(out["leftover_files"]) == expected and out["leftover_bytes"] == nbytes
    assert not any(p.exists() for p in leftovers)
    assert live.exists() and fresh_settings.exists()
    assert _gc(capsys, root)["leftover_files"] == []


def test_verify_reports_and_drops_a_damaged_entry_that_plain_gc_leaves(store_copy, capsys):
    root = store_copy
    store = RagStore.open_existing(root)
    disk = store.kv.tier("disk")
    keys = disk.entry_keys()
    victim = keys[0]
    path = disk.path_of(victim)
    store.close()
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0xFF  # a flipped byte in the last layer: the header reads, the checksum fails
    path.write_bytes(bytes(data))

    assert _gc(capsys, root)["corrupt_entries"] == [] and path.exists()  # no --verify: not read
    dry = _gc(capsys, root, "--verify", "--dry-run")
    assert dry["corrupt_entries"] == [victim] and dry["verified_entries"] == len(keys)
    assert dry["corrupt_bytes"] == len(data) and path.exists()
    out = _gc(capsys, root, "--verify")
    assert out["corrupt_entries"] == [victim] and out["unreferenced_entries"] == 0 and not path.exists()
    store = RagStore.open_existing(root)
    assert store.kv.locate(victim) is None
    assert sorted(store.kv.tier("disk").entry_keys()) == sorted(k for k in keys if k != victim)
    store.close()
    assert _gc(capsys, root, "--verify")["corrupt_entries"] == []

    capsys.readouterr()
    assert main(["store", "gc", "--store", str(root), "--verify"]) == 0
    text = capsys.readouterr().out
    assert f"removed 0 KV entries no chunk uses (0.0 MiB), 0 crash leftovers (0.0 MiB), 0 of {len(keys) - 1} " \
           "KV entries failing their checksum (0.0 MiB)" in text


def test_gc_waits_for_no_ingest_between_its_kv_and_its_commit(tmp_path, capsys):
    """An ingest stores its chunks' KV before it commits the chunks: gc run in between must not take
    that KV for garbage. It is refused while an ingest holds the store, and removes it once none does."""
    root = tmp_path / "store"
    ingest = open_tiny(root)
    with ingest.ingesting():
        put_kv(ingest, "kv-of-a-chunk-not-committed-yet")
        assert main(["store", "gc", "--store", str(root)]) == 2
        assert "an ingest is running on this store" in capsys.readouterr().err
        assert ingest.kv.locate("kv-of-a-chunk-not-committed-yet") == "disk"
    # the ingest died before its commit: its KV is garbage now
    assert _gc(capsys, root)["unreferenced_entries"] == 1
    assert ingest.kv.locate("kv-of-a-chunk-not-committed-yet") is None
    ingest.close()


def test_gc_run_at_every_step_of_an_ingest_never_removes_the_kv_it_is_about_to_commit(store_copy, engine, capsys):
    """gc runs before each step an ingest takes on the store (its ``on_engine`` runner, as a server's
    engine thread would interleave them): refused from the first KV write to the commit, it never
    removes a chunk's KV that was written but not yet committed."""
    from ragfuse.embeddings import Embedder
    from ragfuse.ingest import Ingestor

    root = store_copy
    new = root.parent / "docs" / "harbour.txt"
    new.parent.mkdir()
    new.write_text(" ".join(f"Pier {i} of the Lindholm harbour was rebuilt in {1900 + i} with {i % 7 + 2} cranes."
                            for i in range(120)))
    outcomes: list[int] = []

    def gc_first(step):
        outcomes.append(main(["store", "gc", "--store", str(root), "--json"]))
        return step()

    store = RagStore.open_existing(root)
    try:
        report = Ingestor(store, engine, Embedder(), progress=False, on_engine=gc_first,
                          kv_batch_tokens=1).ingest([new])  # a batch per chunk: steps between their writes
        assert report.new_files == [str(new.resolve())] and report.kv_computed >= 2
        keys = _keys_of(root, str(new.resolve()))
        assert len(keys) == report.kv_computed and all(store.kv.locate(k) == "disk" for k in keys)
        assert 0 in outcomes and 2 in outcomes  # gc ran before the ingest's KV writes, refused after them
        assert "an ingest is running on this store" in capsys.readouterr().err
    finally:
        store.close()


def test_gc_refuses_a_store_whose_model_is_not_found(tmp_path, capsys):
    """Which KV `ask` stored for a chunk is told by the model's keys: without them, everything `ask`
    stored would look unused."""
    root = tmp_path / "store"
    store = RagStore(root, tiny_config(model="no-such-model"))
    put_kv(store, "kv-ask-stored")
    store.close()
    assert main(["store", "gc", "--store", str(root)]) == 2
    assert "cannot tell which KV entries the store's chunks use: model no-such-model is not found" in \
        capsys.readouterr().err
    store = RagStore.open_existing(root)
    with pytest.raises(StoreError, match="model no-such-model is not found"):
        store.gc()
    assert store.kv.locate("kv-ask-stored") == "disk"
    store.close()


def test_removed_chunks_keep_their_kv_while_an_ingest_runs_and_gc_takes_it_after(tmp_path):
    """Two ingests at once: one replacing a file deleted KV that the other had counted as stored for
    a chunk of the same text it had not committed yet, and the store was left referencing missing KV.
    While an ingest holds the store, removed chunks' KV stays; gc removes it once none runs."""
    store = open_tiny(tmp_path / "store")
    add_file(store, "/docs/a.txt", [0], kv_key="kv-of-a")
    put_kv(store, "kv-of-a")
    disk = store.kv.tier("disk")
    with store.ingesting():  # as another process's ingest (its own lock file descriptor)
        assert store.remove(["/docs/a.txt"]) == (1, 0)
        assert disk.contains("kv-of-a")
    report = store.gc(progress=False)
    assert report.unreferenced_entries == 1 and not disk.contains("kv-of-a")
    add_file(store, "/docs/b.txt", [1], kv_key="kv-of-b")
    put_kv(store, "kv-of-b")
    assert store.remove(["/docs/b.txt"]) == (1, 1) and not disk.contains("kv-of-b")  # alone: deleted at once
    store.close()
