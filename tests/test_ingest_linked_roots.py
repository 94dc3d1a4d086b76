"""Re-ingesting a folder whose linked folders were removed or re-pointed: files no ingest root
reaches any more are removed (they kept being retrieved), files another root still holds stay, and a
store made before roots were recorded loses nothing. Real ingests with the default model and embedder."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever
from tests.test_ingest import _config, _ingest, embedder  # noqa: F401 - embedder: the module's fixture

FERRY = "The ferry to Saltmarsh stopped running in 1952."
FERRY_Q = "When did the ferry to Saltmarsh stop running?"
QUARRY = "Granite from the Brenn quarry paved the harbour road."
QUARRY_Q = "Where did the granite for the harbour road come from?"


def _tree(tmp_path: Path, **folders: dict[str, str]) -> list[Path]:
    """Folders under ``tmp_path`` with the given files; ``docs`` always, holding keep.txt."""
    out = []
    for name, files in {"docs": {"keep.txt": "The Hollowpoint lighthouse was electrified in 1931."},
                        **folders}.items():
        d = tmp_path / name
        d.mkdir()
        for file, text in files.items():
            (d / file).write_text(text)
        out.append(d)
    return out


def _names(store: RagStore) -> list[str]:
    return sorted(os.path.basename(p) for p, _ in store.docs.files())


def _sources(store: RagStore, embedder, question: str) -> list[str]:  # noqa: F811
    return [os.path.basename(r.source) for r in Retriever(store, embedder).search(question, 3)]


def test_removing_a_linked_folder_drops_its_files_on_reingest(tmp_path, engine, embedder):  # noqa: F811
    docs, shared = _tree(tmp_path, shared={"ferry.txt": FERRY})
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [docs])
    assert "ferry.txt" in _sources(store, embedder, FERRY_Q)
    gen = store.docs.generation
    assert _ingest(store, engine, embedder, [docs]).chunks_added == 0
    assert store.docs.generation == gen  # recording roots changes no chunk: the saved index stays current

    (docs / "linked").unlink()
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [str((shared / "ferry.txt").resolve())]
    assert (rep.chunks_removed, rep.kv_removed) == (1, 1)
    assert _names(store) == ["keep.txt"] and len(store.index) == 1
    assert "ferry.txt" not in _sources(store, embedder, FERRY_Q)
    store.close()


def test_a_linked_folder_or_file_also_ingested_on_its_own_is_kept(tmp_path, engine, embedder):  # noqa: F811
    docs, shared, loose = _tree(tmp_path, shared={"ferry.txt": FERRY}, loose={"quarry.txt": QUARRY})
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    (docs / "loose").symlink_to(loose, target_is_directory=True)
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [shared])  # the folder on its own, earlier
    _ingest(store, engine, embedder, [loose / "quarry.txt"])  # a file named alone: its own root
    _ingest(store, engine, embedder, [docs])
    (docs / "linked").unlink()
    (docs / "loose").unlink()
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [] and rep.chunks_removed == 0
    assert _names(store) == ["ferry.txt", "keep.txt", "quarry.txt"] and len(store.index) == 3
    assert "ferry.txt" in _sources(store, embedder, FERRY_Q)
    assert "quarry.txt" in _sources(store, embedder, QUARRY_Q)
    store.close()


def test_repointing_a_link_drops_the_old_targets_files_and_adds_the_new(tmp_path, engine, embedder):  # noqa: F811
    docs, old, new = _tree(tmp_path, old={"ferry.txt": FERRY}, new={"quarry.txt": QUARRY})
    link = docs / "linked"
    link.symlink_to(old, target_is_directory=True)
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [docs])
    link.unlink()
    link.symlink_to(new, target_is_directory=True)
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [str((old / "ferry.txt").resolve())]
    assert rep.new_files == [str((new / "quarry.txt").resolve())]
    assert _names(store) == ["keep.txt", "quarry.txt"] and len(store.index) == 2
    assert "ferry.txt" not in _sources(store, embedder, FERRY_Q)
    assert "quarry.txt" in _sources(store, embedder, QUARRY_Q)
    store.close()


def test_a_file_reached_directly_and_through_a_link_is_stored_once(tmp_path, engine, embedder):  # noqa: F811
    """In one ingest of ``docs`` and ``shared``, ``shared`` is also reached through a link in ``docs``
    (and a folder of ``docs`` through another): each file is stored once, and ``shared`` is recorded
    as a root of its files although the walk of ``docs`` went through it first."""
    docs, shared = _tree(tmp_path, shared={"ferry.txt": FERRY})
    (docs / "real").mkdir()
    (docs / "real" / "quarry.txt").write_text(QUARRY)
    (docs / "alias").symlink_to(docs / "real", target_is_directory=True)
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    store = RagStore(tmp_path / "store", _config(embedder))
    rep = _ingest(store, engine, embedder, [docs, shared])
    assert len(rep.new_files) == 3 and rep.chunks_added == 3
    assert store.docs.counts()["files"] == 3 and len(store.index) == 3
    (docs / "linked").unlink()
    (docs / "alias").unlink()
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [] and _names(store) == ["ferry.txt", "keep.txt", "quarry.txt"]
    store.close()


def test_a_store_made_before_roots_were_recorded_loses_nothing(tmp_path, engine, embedder):  # noqa: F811
    """Its files have no recorded roots: kept when a link to them goes (as before roots were
    recorded); files ingested after it opened are mirrored."""
    docs, shared, later = _tree(tmp_path, shared={"ferry.txt": FERRY}, later={"quarry.txt": QUARRY})
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    root = tmp_path / "store"
    store = RagStore(root, _config(embedder))
    _ingest(store, engine, embedder, [docs])
    store.close()
    with sqlite3.connect(root / "docstore.sqlite") as db:  # as a store written before the table
        db.execute("DROP TABLE file_roots")
    store = RagStore(root, _config(embedder))
    assert len(store.index) == 2
    (docs / "linked").unlink()
    (docs / "later").symlink_to(later, target_is_directory=True)
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [] and rep.new_files == [str((later / "quarry.txt").resolve())]
    assert "ferry.txt" in _sources(store, embedder, FERRY_Q)
    (docs / "later").unlink()
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [str((later / "quarry.txt").resolve())]
    assert _names(store) == ["ferry.txt", "keep.txt"] and len(store.index) == 2
    store.close()


def test_a_folder_the_walk_cannot_list_loses_nothing_and_is_reported(tmp_path, engine, embedder, monkeypatch):  # noqa: F811
    """A linked folder that cannot be listed at the re-ingest (permissions; simulated at ``os.scandir``,
    since this suite may run as root, whom permissions do not stop) is not "no longer reached": its files
    stay stored, and the ingest names the folder among the skipped instead of passing over it."""
    docs, shared = _tree(tmp_path, shared={"ferry.txt": FERRY})
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [docs])
    scandir = os.scandir

    def refusing(path=".", *args, **kwargs):
        if os.path.realpath(path) == str(shared.resolve()):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", refusing)
    rep = _ingest(store, engine, embedder, [docs])
    monkeypatch.undo()
    assert rep.removed_files == [] and rep.chunks_removed == 0
    assert any("cannot list folder" in s.reason and s.path.endswith("linked") for s in rep.skipped), rep.skipped
    assert _names(store) == ["ferry.txt", "keep.txt"]
    (docs / "linked").unlink()  # a later complete walk still removes what no root reaches
    assert _ingest(store, engine, embedder, [docs]).removed_files == [str((shared / "ferry.txt").resolve())]
    store.close()
