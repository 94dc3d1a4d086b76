"""Ingest and retrieval on a few small real documents, with the default model and embedder."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ragfuse.documents import load_file
from ragfuse.embeddings import Embedder
from ragfuse.engine.kvstore import kv_key
from ragfuse.ingest import Ingestor, token_batches
from ragfuse.prompt import RagPromptBuilder
from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever
from ragfuse.store_dir import StoreConfig, StoreError

DOCS = {
    "eiffel.txt": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was completed in 1889.",
    "rust.md": "# Rust\n\nRust is a systems programming language that guarantees memory safety without a garbage "
               "collector.",
    "page.html": "<html><head><script>var x = 1;</script></head><body><h1>Volcanoes</h1><p>Mount Etna is an active "
                 "volcano on the island of Sicily.</p></body></html>",
}


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def _config(embedder, chunk_tokens=64, index="flat"):
    return StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, index, chunk_tokens, 8)


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for name, text in DOCS.items():
        (d / name).write_text(text)
    (d / "records.jsonl").write_text("\n".join(json.dumps({"title": t, "text": x}) for t, x in [
        ("Mount Fuji", "Mount Fuji is the highest mountain in Japan."),
        ("Danube", "The Danube flows through ten countries into the Black Sea."),
    ]))
    (d / "empty.txt").write_text("  \n")
    (d / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "big.txt").write_text("x " * 2000)
    return d


def _ingest(store, engine, embedder, paths, **kw):
    return Ingestor(store, engine, embedder, progress=False, **kw).ingest(paths)


def test_ingest_search_reingest_change_remove(tmp_path, corpus, engine, embedder):
    store = RagStore(tmp_path / "store", _config(embedder))
    rep = _ingest(store, engine, embedder, [corpus], max_bytes=3000)
    assert len(rep.new_files) == 4 and rep.chunks_added == 5
    skipped = {s.path.rsplit("/", 1)[-1]: s.reason for s in rep.skipped}
    assert skipped["empty.txt"] == "empty" and skipped["blob.txt"].startswith("binary")
    assert "not UTF-8" in skipped["latin1.txt"] and "larger than the limit" in skipped["big.txt"]
    retriever = Retriever(store, embedder)
    top = retriever.search("Which volcano is on Sicily?", top_k=2)
    assert top[0].source.endswith("page.html") and "Etna" in top[0].text and "var x" not in top[0].text
    assert top[0].score > top[1].score
    fuji = retriever.search("highest mountain in Japan", top_k=1)[0]
    assert fuji.source.endswith("records.jsonl#0.text") and fuji.text.startswith("Mount Fuji\n")

    # every chunk's KV is stored, keyed by its token ids and the instruction prefix it was computed
    # after (a new store's default), and equals a fresh computation after that prefix, not alone
    chunk = store.docs.chunks([top[0].id])[top[0].id]
    entry = store.kv.get(chunk.kv_key)
    prefix = RagPromptBuilder(engine.tokenizer).prefix
    assert chunk.kv_key == kv_key(engine.fingerprint, engine.dtype, chunk.token_ids, prefix)
    k, v = engine.compute_kv([list(chunk.token_ids)], context=prefix)[0]
    assert torch.allclose(entry.kv()[0], k, atol=1e-5) and torch.allclose(entry.kv()[1], v, atol=1e-5)
    alone_k, _ = engine.compute_kv([list(chunk.token_ids)])[0]
    assert not torch.allclose(entry.kv()[0], alone_k, atol=1e-3)

    again = _ingest(store, engine, embedder, [corpus], max_bytes=3000)
    assert len(again.unchanged_files) == 4 and again.chunks_added == 0 and again.kv_computed == 0
    gen = store.docs.generation

    (corpus / "eiffel.txt").write_text("The Eiffel Tower is 330 metres tall.")
    changed = _ingest(store, engine, embedder, [corpus / "eiffel.txt"])
    assert changed.replaced_files and changed.chunks_removed == 1 and changed.chunks_added == 1
    assert changed.kv_removed == 1 and store.docs.generation > gen
    assert "330 metres" in retriever.search("How tall is the Eiffel Tower?", top_k=1)[0].text
    assert len(store.index) == store.docs.counts()["chunks"] == 5

    chunks, kv = store.remove([str((corpus / "rust.md").resolve())])
    assert (chunks, kv) == (1, 1) and len(store.index) == 4
    assert all("Rust" not in r.text for r in retriever.search("memory safe programming language", top_k=4))
    store.close()


def test_failed_ingest_loses_nothing_and_stale_index_is_rebuilt(tmp_path, corpus, engine, embedder):
    root = tmp_path / "store"
    store = RagStore(root, _config(embedder))
    _ingest(store, engine, embedder, [corpus / "eiffel.txt"])
    store.close()
    (root / "index.faiss.json").write_text('{"generation": -1, "kind": "flat"}')  # as if a crash left it stale
    store = RagStore(root, _config(embedder), kv_capacity_gb=1e-6)  # too small to hold any KV entry
    assert len(store.index) == 1
    rep = _ingest(store, engine, embedder, [corpus / "rust.md"])
    assert rep.kv_computed == 1 and store.docs.counts()["files"] == 2
    with pytest.raises(StoreError, match="other settings"):
        RagStore(root, _config(embedder, chunk_tokens=128))
    store.close()


def test_an_ingest_within_a_smaller_kv_capacity_counts_the_kv_it_evicts(tmp_path, corpus, engine, embedder):
    """`--kv-capacity-gb` applies to the run that gives it: less than the store holds evicted other
    files' KV (the instruction prefix's too) while the report said "removed 0". It counts them now."""
    root = tmp_path / "store"
    store = RagStore(root, _config(embedder))
    _ingest(store, engine, embedder, [corpus / "eiffel.txt"])
    held = store.kv.tier("disk").stats()
    store.close()
    store = RagStore(root, _config(embedder), kv_capacity_gb=held.bytes / 2**30)  # full already
    rep = _ingest(store, engine, embedder, [corpus / "rust.md"])
    after = store.kv.tier("disk").stats()
    assert rep.kv_computed == 1 and rep.kv_removed == 0 and rep.kv_evicted >= 1
    assert after.entries == held.entries + 1 - rep.kv_evicted
    store.close()


def test_a_store_kept_inside_the_documents_is_not_ingested_as_documents(tmp_path, corpus, engine, embedder):
    """`ingest docs --store docs/store` listed the store's own settings and index as skipped files
    (with a --text-field hint), and would read a server's uploads there a second time."""
    store = RagStore(corpus / "store", _config(embedder))
    (corpus / "store" / "uploads").mkdir()
    (corpus / "store" / "uploads" / "up.md").write_text("An uploaded note about lighthouses.")
    rep = _ingest(store, engine, embedder, [corpus], precompute_kv=False)
    assert not [f for f in rep.new_files if "/store/" in f]
    assert not [s for s in rep.skipped if "/store/" in s.path], rep.skipped
    store.close()


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_indexes(tmp_path, corpus, engine, embedder, kind):
    store = RagStore(tmp_path / kind, _config(embedder, index=kind))
    _ingest(store, engine, embedder, [corpus], precompute_kv=False)
    assert Retriever(store, embedder).search("Danube Black Sea", top_k=1)[0].text.startswith("Danube")
    n = len(store.index)
    store.remove([str((corpus / "records.jsonl").resolve())])
    assert len(store.index) == n - 2
    store.close()


def test_nested_json_records(tmp_path):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([{"ctxs": [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]},
                                {"ctxs": [{"text": "gamma"}]}]))
    loaded = load_file(path, text_field="ctxs[].text")
    assert [(d.text, d.source.split("#")[1]) for d in loaded.documents] == [
        ("A\nalpha", "0.ctxs[0].text"), ("B\nbeta", "0.ctxs[1].text"), ("gamma", "1.ctxs[0].text")]
    assert "no record has" in load_file(path, text_field="body").reason


def test_a_no_kv_ingest_then_a_kv_ingest_precomputes_the_kv(tmp_path, corpus, engine, embedder):
    store = RagStore(tmp_path / "store", _config(embedder))
    eiffel = corpus / "eiffel.txt"
    first = _ingest(store, engine, embedder, [eiffel], precompute_kv=False)
    assert first.new_files and first.kv_computed == 0
    ids = store.docs.chunk_ids(str(eiffel.resolve()))
    generation = store.docs.generation
    # the same unchanged file, now wanting KV: its chunks have none, so they get it, kept as they are
    # (the same ids, which clients saw in sources; not embedded again, so the index is untouched)
    second = _ingest(store, engine, embedder, [eiffel])
    assert second.kv_filled_files == second.unchanged_files == [str(eiffel.resolve())] and second.kv_computed == 1
    assert store.docs.chunk_ids(str(eiffel.resolve())) == ids and store.docs.generation == generation
    assert [store.kv.locate(c.kv_key) for c in store.docs.chunks(ids).values()] == ["disk"]
    third = _ingest(store, engine, embedder, [eiffel])
    assert third.unchanged_files and third.kv_computed == 0 and third.chunks_added == 0
    assert _ingest(store, engine, embedder, [eiffel], precompute_kv=False).unchanged_files  # --no-kv: KV not asked
    store.close()


def test_a_chunk_that_moves_to_another_file_keeps_its_kv(tmp_path, engine, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    moving = "Saltmarsh harbour was dredged in 1874 to admit larger steamers."
    (docs / "a.txt").write_text(moving)
    store = RagStore(tmp_path / "store", _config(embedder))
    assert _ingest(store, engine, embedder, [docs]).kv_computed == 1
    (docs / "b.txt").write_text(moving)  # the paragraph moves to b.txt, and a.txt says something else
    (docs / "a.txt").write_text("Saltmarsh harbour now only serves fishing boats.")
    rep = _ingest(store, engine, embedder, [docs])
    assert (len(rep.new_files), len(rep.replaced_files), rep.kv_computed, rep.kv_reused) == (1, 1, 1, 1)
    assert rep.kv_removed == 0  # a.txt's old key is b.txt's chunk's now
    chunks = [c for p, _ in store.docs.files() for c in store.docs.chunks(store.docs.chunk_ids(p)).values()]
    assert sorted(store.kv.locate(c.kv_key) for c in chunks) == ["disk", "disk"]
    _, kv_removed = store.remove([str((docs / "b.txt").resolve())])  # the last chunk using it gone: so is the KV
    assert kv_removed == 1
    store.close()


def test_files_that_cannot_be_read_are_skipped_and_the_rest_ingested(tmp_path, engine, embedder):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.txt").write_text("The Danube flows through ten countries into the Black Sea.")
    (docs / "deep.json").write_bytes(b"[" * 100_000)
    (docs / "loop.pdf").write_bytes(  # no catalog; pypdf meets object 2 again: LimitReachedError
        b"%PDF-1.4\n1 0 obj\n<< /Type /Xatalog /Pages 2 0 R >>\nendobj\n2 0 obj\nX<\nendobj\n"
        b"xref\n0 3\n0000000000 65535 f \n0000000009 00000 n \n0000000058 00000 n \n"
        b"trailer\n<< /Size 3 /Root 1 0 R >>\nstartxref\n76\n%%EOF\n")
    with open(os.path.join(os.fsencode(docs), b"caf\xe9-menu.txt"), "wb") as f:  # a Latin-1 file name
        f.write(b"Soup of the day.")
    store = RagStore(tmp_path / "store", _config(embedder))
    rep = _ingest(store, engine, embedder, [docs], precompute_kv=False)
    assert rep.new_files == [str((docs / "good.txt").resolve())]
    reasons = {s.path.rsplit("/", 1)[-1]: s.reason for s in rep.skipped}
    assert reasons.keys() == {"deep.json", "loop.pdf", "caf\\xe9-menu.txt"}
    assert reasons["deep.json"] == "JSON nested too deeply to read" and "unreadable PDF" in reasons["loop.pdf"]
    assert "not valid UTF-8" in reasons["caf\\xe9-menu.txt"]
    store.close()


def test_reingesting_a_folder_removes_its_deleted_files_but_not_files_named_alone(tmp_path, engine, embedder):
    docs, other = tmp_path / "docs", tmp_path / "other"
    docs.mkdir()
    other.mkdir()
    (docs / "keep.txt").write_text("The Hollowpoint lighthouse was electrified in 1931.")
    (docs / "old.txt").write_text("The ferry to Saltmarsh stopped running in 1952.")
    (other / "alone.txt").write_text("Granite from the Brenn quarry paved the harbour road.")
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [docs, other / "alone.txt"])
    retriever = Retriever(store, embedder)
    assert "old.txt" in retriever.search("When did the ferry stop running?", 1)[0].source
    (docs / "old.txt").unlink()
    (other / "alone.txt").unlink()  # named alone, not through a folder: the user removes it with `store rm`
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [str((docs / "old.txt").resolve())] and rep.chunks_removed == 1
    assert rep.kv_removed == 1 and rep.unchanged_files == [str((docs / "keep.txt").resolve())]
    assert sorted(os.path.basename(p) for p, _ in store.docs.files()) == ["alone.txt", "keep.txt"]
    assert all("old.txt" not in r.source for r in retriever.search("When did the ferry stop running?", 3))
    assert len(store.index) == 2
    store.close()


def test_a_file_deleted_under_a_linked_folder_is_removed_on_reingest(tmp_path, engine, embedder):
    """Files found through a linked folder are stored by their real paths, outside the folder
    ingested: mirroring the folder covers the link's target too (its deleted file was kept and
    kept being retrieved), and a file elsewhere that was never under the folder stays."""
    shared, docs = tmp_path / "shared", tmp_path / "docs"
    shared.mkdir()
    docs.mkdir()
    (docs / "keep.txt").write_text("The Hollowpoint lighthouse was electrified in 1931.")
    (shared / "old.txt").write_text("The ferry to Saltmarsh stopped running in 1952.")
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    (tmp_path / "outside.txt").write_text("Granite from the Brenn quarry paved the harbour road.")
    store = RagStore(tmp_path / "store", _config(embedder))
    _ingest(store, engine, embedder, [docs, tmp_path / "outside.txt"])
    (shared / "old.txt").unlink()
    (tmp_path / "outside.txt").unlink()  # named alone: `store rm` removes it, not a folder's re-ingest
    rep = _ingest(store, engine, embedder, [docs])
    assert rep.removed_files == [str((shared / "old.txt").resolve())] and rep.chunks_removed == 1
    assert sorted(os.path.basename(p) for p, _ in store.docs.files()) == ["keep.txt", "outside.txt"]
    store.close()


def test_kv_batches_stay_within_their_token_bound():
    """Each batch is one call on a server's engine thread that running streams wait for: a batch
    never takes one more chunk past the bound (it was cut only after passing it, up to twice the
    bound), a chunk longer than the bound goes alone, and order and items are kept."""
    items = [(f"k{i}", tuple(range(n))) for i, n in enumerate([300, 300, 100, 700, 50, 50, 512])]
    batches = token_batches(items, 512)
    assert [[k for k, _ in b] for b in batches] == [["k0"], ["k1", "k2"], ["k3"], ["k4", "k5"], ["k6"]]
    assert [item for b in batches for item in b] == items and token_batches([], 512) == []

