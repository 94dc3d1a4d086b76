"""The ingest/search/store/profile commands end to end, and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragfuse.cli import main


def test_cli_ingest_search_stats_rm(tmp_path, capsys, engine):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.")
    (docs / "b.txt").write_text("The Great Wall of China is thousands of kilometres long.")
    (docs / "c.bin.txt").write_bytes(b"\x00\xff")
    store = str(tmp_path / "store")
    assert main(["ingest", str(docs), "--store", store, "--device", "cpu", "--chunk-tokens", "128", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["new_files"]) == 2 and report["kv_computed"] == 2 and len(report["skipped"]) == 1

    assert main(["search", "how do plants make oxygen", "--store", store, "--top-k", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (hit,) = out["sources"]
    assert set(hit) == {"id", "text", "source", "score"} and hit["source"].endswith("a.txt")

    assert main(["store", "stats", "--store", store, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["files"] == 2 and stats["kv"]["disk"]["entries"] == 3  # and the instruction prefix's

    assert main(["store", "rm", str(docs / "b.txt"), "--store", store]) == 0
    assert "removed 1 files, 1 chunks, 1 KV entries" in capsys.readouterr().out


def test_cli_ingest_keeps_a_store_s_chunk_kv_context(tmp_path, capsys, engine):
    """A store made before the chunk KV context setting (its store.json lacks it) holds chunks' KV
    computed alone: a later ingest keeps that (its new chunks are keyed and computed alone too) unless
    asked otherwise, which is refused as any other changed setting is."""
    from ragfuse.engine.kvstore import kv_key
    from ragfuse.rag_store import RagStore
    from ragfuse.store_dir import StoreConfig, StoreError

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.")
    store = tmp_path / "store"
    args = ["--store", str(store), "--device", "cpu", "--chunk-tokens", "128", "--json"]
    assert main(["ingest", str(docs / "a.txt"), *args]) == 0
    saved = json.loads((store / "store.json").read_text())
    assert saved["chunk_kv_context"] == "instruction"  # a new store's default
    del saved["chunk_kv_context"]
    (store / "store.json").write_text(json.dumps(saved))
    assert StoreConfig.load(store).chunk_kv_context == "none"
    (docs / "b.txt").write_text("The Great Wall of China is thousands of kilometres long.")
    assert main(["ingest", str(docs / "b.txt"), *args]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["kv_computed"] == 1
    rag = RagStore.open_existing(store)
    (chunk,) = [c for c in rag.docs.chunks(rag.docs.chunk_ids(str((docs / "b.txt").resolve()))).values()]
    assert chunk.kv_key == kv_key(engine.fingerprint, engine.dtype, chunk.token_ids)
    rag.close()
    assert main(["ingest", str(docs), *args, "--chunk-kv-context", "instruction"]) == 2
    assert "chunk_kv_context: store has 'none', asked 'instruction'" in capsys.readouterr().err
    (store / "store.json").write_text(json.dumps({**saved, "chunk_kv_context": "somewhere"}))
    with pytest.raises(StoreError, match="chunk KV context must be one of instruction, none"):
        StoreConfig.load(store)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["search", "anything", "--store", str(tmp_path / "none")]) == 2
    assert "no ragfuse store" in capsys.readouterr().err
    assert main(["search", "  ", "--store", str(tmp_path)]) == 2
    assert "QUERY is empty" in capsys.readouterr().err


def test_cli_profile_caches_a_profile(tmp_path, capsys, engine):
    docs = tmp_path / "a.txt"
    docs.write_text("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.")
    store = tmp_path / "store"
    store.mkdir()
    args = ["--store", str(store), "--device", "cpu", "--lengths", "64,128", "--entries", "2",
            "--entry-tokens", "64", "--context", "160"]
    assert main(["profile", *args]) == 2  # a folder nothing was ingested into holds no store to profile for
    assert "no ragfuse store at" in capsys.readouterr().err and not (store / "profiles").exists()
    assert main(["ingest", str(docs), "--store", str(store), "--device", "cpu", "--chunk-tokens", "64"]) == 0
    assert main(["profile", *args, "--model", "qwen2-0.5b"]) == 2  # not the store's model
    assert "ingested with model 'smollm2-135m-instruct'" in capsys.readouterr().err
    assert main(["profile", *args, "--entry-tokens", "5000000"]) == 2  # was a 115 GB allocation after measuring
    assert "--entry-tokens 5000000 goes past the model's context" in capsys.readouterr().err
    assert main(["profile", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    prof = out["profile"]
    assert [n for n, _ in prof["prefill_points"]] == [64, 128] and all(s > 0 for _, s in prof["prefill_points"])
    # fused passes over 40 and 160 stored tokens (64 + 64 + 32) at each ratio, every point a share of a
    # full pass's time; over 160 recomputing none costs less than recomputing all
    curves = {n: [(r, f) for m, r, f in prof["recompute_points"] if m == n] for n in (40, 160)}
    assert all([r for r, _ in c] == [0.0, 0.05, 0.15, 0.3, 0.5, 1.0] for c in curves.values())
    assert all(f > 0 for c in curves.values() for _, f in c) and curves[160][0][1] < curves[160][-1][1], curves
    assert set(prof["bandwidth"]) == {"cpu", "disk"} and prof["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4
    assert out["decision"]["num_tokens"] == 160 and 0.15 <= out["decision"]["recompute_ratio"] <= 1
    assert len(list((store / "profiles").glob("profile-*.json"))) == 1
    saved = Path(out["path"])
    saved.unlink()
    saved.mkdir()  # a folder where the profile belongs failed the save only after the whole measurement
    assert main(["profile", *args]) == 2
    assert f"{saved} is a folder where this model's profile belongs" in capsys.readouterr().err


def test_profile_passes_recompute_every_stored_token_at_100_percent(engine):
    """The passes timed put a stored prompt start first, as ask's chunks follow its instruction: a
    prompt's first segment is an exact prefix, never recomputed, so without it the first chunk was
    not either, and the curve's 100% timed a pass recomputing a quarter of a full prefill's tokens."""
    from ragfuse.commands.profile import profile_prompt
    from ragfuse.engine.fusion import SelectionPolicy
    from ragfuse.engine.kvstore import MemoryTier

    prompt = profile_prompt(engine, 160, 64)
    assert [len(c) for c in prompt.chunks] == [32, 64, 64, 32]
    prompt.keep_in(MemoryTier("cpu", "cpu", prompt.kv_bytes * 2))
    stats = prompt.run("cpu", "fuse", SelectionPolicy.default().with_ratio(1.0))
    assert stats.computed_tokens == 160 + 32 and stats.reused_tokens == 32  # the prompt start alone reused
    stats = prompt.run("cpu", "fuse", SelectionPolicy.default().with_ratio(0.25))
    assert stats.recomputed_tokens == 40


def test_cli_ingest_of_nothing_fails_and_makes_no_store(tmp_path, capsys):
    """A mistyped path, or a new store's folder without documents, is an error before any model loads,
    and no store is left behind (a later `ask` would only then say the store is empty)."""
    store = tmp_path / "store"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Photosynthesis turns light into sugar.")
    assert main(["ingest", str(docs), str(tmp_path / "typo.md"), "--store", str(store)]) == 2
    assert f"no such file or directory: {tmp_path / 'typo.md'} (nothing was ingested)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["ingest", str(tmp_path / "empty"), "--store", str(store)]) == 2
    assert "no documents in" in capsys.readouterr().err
    assert not store.exists()
    with pytest.raises(SystemExit, match="2"):  # argparse's own error
        main(["ingest", str(docs), "--store", str(store), "--encoding", "no-such-codec"])
    assert "unknown encoding 'no-such-codec'" in capsys.readouterr().err


def test_cli_ingest_that_skips_every_file_fails_and_a_fallback_encoding_reads_them(tmp_path, capsys, engine):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "menu.txt").write_bytes("Caf\u00e9 cr\u00e8me is served at the Hollowpoint ferry.".encode("latin-1"))
    (docs / "blob.txt").write_bytes(b"\x00\x01")
    args = ["--store", str(tmp_path / "store"), "--device", "cpu", "--chunk-tokens", "128"]
    assert main(["ingest", str(docs), *args]) == 2
    captured = capsys.readouterr()
    assert "skipped" in captured.out and "not UTF-8 text" in captured.out
    assert "nothing ingested: every file was skipped" in captured.err
    assert main(["ingest", str(docs), *args, "--encoding", "windows-1252"]) == 0
    out = capsys.readouterr().out
    assert f"note {docs / 'menu.txt'}: not UTF-8: read as cp1252" in out and "1 new" in out
