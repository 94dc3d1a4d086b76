"""Ingest, store and ``ragfuse ask`` faults a demanding user hits: record files that did not read,
re-ingests that kept stale chunks or missing KV, settings to repeat on every ingest, and an empty
store that cost minutes of calibration before it was told."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ragfuse.cli import main
from ragfuse.docstore import NewChunk
from ragfuse.documents import LoadedFile, SkippedFile, load_file
from ragfuse.embeddings import Embedder
from ragfuse.ingest import Ingestor
from ragfuse.rag_store import RagStore
from ragfuse.retrieval import Retriever
from ragfuse.store_dir import StoreConfig
from tests.tiny_store import add_file, open_tiny, unit


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def _texts(loaded: LoadedFile | SkippedFile) -> list[str]:
    assert isinstance(loaded, LoadedFile), loaded
    return [d.text for d in loaded.documents]


def test_a_json_record_with_an_integer_too_long_for_python_is_still_read(tmp_path):
    """Python's int() refuses more than 4300 digits with a ValueError json does not turn into a
    JSONDecodeError: such a number in any field used to end the whole ingest with a traceback."""
    path = tmp_path / "ids.json"
    path.write_text('[{"text": "Copper is mined in Chile.", "checksum": ' + "9" * 5000 + "}]")
    assert _texts(load_file(path)) == ["Copper is mined in Chile."]


def test_jsonl_records_holding_unicode_line_breaks_stay_whole(tmp_path):
    """JSON strings may hold U+2028 and U+0085 unescaped (``json.dumps(ensure_ascii=False)`` writes
    them so); str.splitlines cut records there, and the whole file was skipped as invalid JSON."""
    records = [{"text": "First\u2028line, then\x85more."}, {"text": "Second record."}]
    path = tmp_path / "web.jsonl"
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in records), encoding="utf-8")
    assert _texts(load_file(path)) == [r["text"] for r in records]


def test_an_invalid_jsonl_record_is_named_by_its_line_in_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n\n{"text": three}\n')
    skipped = load_file(path)
    assert isinstance(skipped, SkippedFile) and "at line 4" in skipped.reason, skipped


def test_reingesting_records_with_another_text_field_reads_them_again(tmp_path, engine, embedder):
    """The file's bytes did not change, but what is taken from them did: it used to be reported
    unchanged and the chunks of the old field stayed the only ones served."""
    docs = tmp_path / "docs"
    docs.mkdir()
    path = docs / "cases.jsonl"
    path.write_text(json.dumps({"title": "Case", "summary": "Volcanoes erupt.", "text": "Cats purr."}))
    config = StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, "flat", 64, 0)
    store = RagStore(tmp_path / "store", config)
    try:
        for field, text in [("text", "Case\nCats purr."), ("summary", "Case\nVolcanoes erupt.")]:
            report = Ingestor(store, engine, embedder, precompute_kv=False, progress=False,
                              text_field=field).ingest([docs])
            assert not report.unchanged_files and report.chunks_added == 1, (field, report)
            ids = store.docs.chunk_ids(str(path.resolve()))
            assert [c.text for c in store.docs.chunks(ids).values()] == [text]
        again = Ingestor(store, engine, embedder, precompute_kv=False, progress=False,
                         text_field="summary").ingest([docs])
        assert again.unchanged_files == [str(path.resolve())]
    finally:
        store.close()


def test_reingest_computes_the_kv_whose_file_was_removed_behind_the_store(tmp_path, engine, embedder):
    """A disk entry whose file is gone (deleted to free space, lost) is no stored KV: a process that
    keeps the store open (a server taking uploads) used to find the file unchanged, and ingest left
    every such chunk to be computed on the next question."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "keeper.txt").write_text("The lighthouse keeper of Norvik lit the lamp every evening.")
    config = StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, "flat", 64, 0, "none")
    store = RagStore(tmp_path / "store", config)
    try:
        ingestor = Ingestor(store, engine, embedder, progress=False)
        assert ingestor.ingest([docs]).kv_computed == 1
        keeper = [str((docs / "keeper.txt").resolve())]
        (key,) = [c.kv_key for c in store.docs.chunks(store.docs.chunk_ids(keeper[0])).values()]
        store.kv.tier("disk").path_of(key).unlink()
        assert store.kv.locate(key) is None
        report = ingestor.ingest([docs])  # read again for its KV alone: its text is unchanged
        assert report.kv_filled_files == report.unchanged_files == keeper and report.kv_computed == 1
        assert store.kv.get(key) is not None
    finally:
        store.close()


def test_ask_on_a_store_without_chunks_is_refused_before_a_model_loads(tmp_path):
    """A store whose ingest read nothing (or emptied by `store rm`) has settings but no chunk:
    `ask` loaded the model and, without a cached r*, calibrated the accuracy gate for minutes before
    saying so. Run with a model cache that holds no gate calibration, under a time limit."""
    from ragfuse.engine.checkpoint import cache_root

    open_tiny(tmp_path / "store").close()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models")
    r = subprocess.run([sys.executable, "-m", "ragfuse.cli", "ask", "When was it built?", "--store",
                        str(tmp_path / "store")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "RAGFUSE_CACHE": str(cache)})
    assert r.returncode == 2 and "has no documents" in r.stderr, r.stderr
    assert not (cache / "gate").exists()


def test_ingest_takes_the_store_s_settings_where_none_are_given(tmp_path, capsys, engine):
    """Adding files to a store made with non-default settings used to be refused unless every
    option was repeated, with advice to empty the store; a setting given otherwise is still
    refused, before a model loads, and the store keeps its files."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in [("a.txt", "Bees make honey."), ("b.txt", "Owls hunt at night."), ("c.txt", "Rain falls.")]:
        (docs / name).write_text(text)
    store = tmp_path / "store"
    base = ["--store", str(store), "--device", "cpu", "--no-kv", "--json"]
    assert main(["ingest", str(docs / "a.txt"), *base, "--chunk-tokens", "64", "--index", "hnsw"]) == 0
    assert main(["ingest", str(docs / "b.txt"), *base]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["new_files"]) == 1
    saved = StoreConfig.load(store)
    assert saved is not None and (saved.chunk_tokens, saved.index_kind) == (64, "hnsw")
    assert main(["ingest", str(docs / "c.txt"), *base, "--chunk-tokens", "128"]) == 2
    assert "chunk_tokens: store has 64, asked 128" in capsys.readouterr().err
    assert main(["store", "stats", "--store", str(store), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 2


def test_a_store_kept_open_finds_what_another_process_ingests(tmp_path, engine, embedder):
    """A long-running reader (``ragfuse serve``, the demo) searched the index it loaded at start: a
    ``ragfuse ingest`` beside it was never found, and chunks it replaced were silently lost. Its own
    ingests after such a refresh must not hold a chunk twice either. (The writer is a second store
    object with its own docstore connection, as a second process has.)"""
    docs = tmp_path / "docs"
    docs.mkdir()
    owls = docs / "owls.txt"
    owls.write_text("Owls hunt mice at night.")
    config = StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, "flat", 64, 0)
    server = RagStore(tmp_path / "store", config)
    retriever = Retriever(server, embedder)

    def ingest(store: RagStore, path) -> None:
        Ingestor(store, engine, embedder, precompute_kv=False, progress=False).ingest([path])

    try:
        for text in ["Owls hunt mice at night.", "Owls sleep through the day."]:
            owls.write_text(text)
            other = RagStore(tmp_path / "store", config)
            ingest(other, owls)
            other.close()
            assert [r.text for r in retriever.search("What do owls do?", top_k=3)] == [text]
        (docs / "bees.txt").write_text("Bees make honey.")
        ingest(server, docs / "bees.txt")
        assert len(server.index) == server.docs.counts()["chunks"] == 2
        assert len(retriever.search("What do owls do?", top_k=5)) == 2
    finally:
        server.close()


def test_a_refresh_between_a_commit_and_its_index_update_leaves_each_chunk_once(tmp_path):
    """A search on another thread may refresh the index (another process committed) after this
    process committed chunks but before it brought its index in line: that update must not add
    them a second time."""
    server, other = open_tiny(tmp_path / "store"), open_tiny(tmp_path / "store")
    try:
        chunk = NewChunk("a.txt", "chunk of a", (1,), None, unit(0))
        removed, added = server.docs.replace_file("a.txt", "hash of a", [chunk])
        add_file(other, "b.txt", [1])
        assert len(server.current_index()) == 2
        server.apply_changes(removed, added, unit(0)[None])
        assert len(server.index) == 2
    finally:
        server.close()
        other.close()


def test_store_rm_with_paths_and_all_is_refused_and_removes_nothing(tmp_path, capsys):
    """`store rm old.txt --all` ignored the path and emptied the whole store, settings included."""
    store = open_tiny(tmp_path / "store")
    add_file(store, str(tmp_path / "keep.txt"), [0])
    store.close()
    assert main(["store", "rm", str(tmp_path / "old.txt"), "--all", "--store", str(tmp_path / "store")]) == 2
    assert "name no PATH" in capsys.readouterr().err
    store = open_tiny(tmp_path / "store")
    try:
        assert store.docs.counts()["files"] == 1 and StoreConfig.load(tmp_path / "store") is not None
    finally:
        store.close()


def test_a_record_with_half_an_emoji_is_ingested_with_a_replacement_character(tmp_path, engine, embedder):
    """JSON may escape a lone surrogate (scraped text cut inside an emoji): the tokenizer raised a
    TypeError on it and the whole ingest ended, no file of it stored."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "posts.jsonl").write_text('{"text": "A day at the beach \\ud83d"}\n'
                                      '{"text": "Rain all day \\ud83d\\ude00"}\n')
    config = StoreConfig("smollm2-135m-instruct", embedder.name, embedder.dim, "flat", 64, 0)
    store = RagStore(tmp_path / "store", config)
    try:
        report = Ingestor(store, engine, embedder, precompute_kv=False, progress=False).ingest([docs])
        assert report.chunks_added == 2
        texts = {c.text for c in store.docs.chunks(store.docs.chunk_ids(report.new_files[0])).values()}
        assert texts == {"A day at the beach \ufffd", "Rain all day \U0001f600"}
    finally:
        store.close()


def test_ask_compare_and_bench_fusion_say_slower_when_the_fused_request_was_slower() -> None:
    from ragfuse.bench.report import speed_phrase

    assert speed_phrase(4.04, 1) == "4.0x faster"
    assert speed_phrase(0.2, 1) == "5.0x slower"  # `ask --compare` printed "0.2x faster"
    assert speed_phrase(0.3125) == "3.20x slower"  # bench fusion's disk rows: "0.31x faster"
    assert speed_phrase(1.0) == "1.00x faster"
