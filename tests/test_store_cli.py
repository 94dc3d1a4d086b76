"""`ragfuse ingest` and `ragfuse store rm --all` on a store's settings: a refused option records
nothing, and `rm --all` leaves a store whose settings the next ingest sets."""

from __future__ import annotations

import json

import pytest

from ragfuse.cli import main
from ragfuse.rag_store import RagStore
from ragfuse.store_dir import StoreConfig, StoreError
from tests.tiny_store import add_file, open_tiny, put_kv, tiny_config


@pytest.mark.parametrize("option", [["--chunk-overlap", "-1"], ["--chunk-overlap", "512"], ["--chunk-tokens", "8"]])
def test_ingest_refuses_chunk_settings_before_writing_anything(tmp_path, capsys, option):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The Hollowpoint lighthouse was electrified in 1931.")
    store = tmp_path / "store"
    assert main(["ingest", str(docs), "--store", str(store), "--no-kv", "--device", "cpu", *option]) == 2
    assert f"{option[0]} must be" in capsys.readouterr().err
    assert not store.exists()


def test_store_settings_a_chunker_refuses_are_a_store_error():
    with pytest.raises(StoreError, match=r"--chunk-overlap must be in \[0, 64\), got 64"):
        tiny_config(chunk_tokens=64, chunk_overlap=64)
    with pytest.raises(StoreError, match="--chunk-tokens must be at least 16, got 15"):
        tiny_config(chunk_tokens=15)


def test_rm_all_resets_the_settings_and_an_empty_store_stays_removable(tmp_path, capsys):
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1], kv_key="kv-of-a")
    put_kv(store, "kv-of-a")
    put_kv(store, "kv-of-the-prefix")  # stored by `ask`, no chunk's
    store.close()
    with pytest.raises(StoreError, match="use another --store or `ragfuse store rm --all` first"):
        RagStore(root, tiny_config(chunk_tokens=256))
    assert main(["store", "rm", "--all", "--store", str(root)]) == 0
    assert "removed 1 files, 2 chunks, 2 KV entries; the store's settings are reset" in capsys.readouterr().out
    assert not (root / "store.json").exists()
    store = RagStore(root, tiny_config(chunk_tokens=256))  # what the mismatch error advised now works
    assert store.docs.counts()["chunks"] == 0 and len(store.index) == 0 and store.kv.stats()["disk"].entries == 0
    store.close()
    assert StoreConfig.load(root).chunk_tokens == 256
    for _ in range(2):  # settings and no file, then no settings: both an empty store
        assert main(["store", "rm", "--all", "--store", str(root)]) == 0
        assert "removed 0 files, 0 chunks, 0 KV entries" in capsys.readouterr().out
    assert main(["store", "rm", "--all", "--store", str(tmp_path / "nothing")]) == 2
    assert "no ragfuse store" in capsys.readouterr().err


def test_rm_all_forgets_settings_no_ingest_accepts_where_no_file_used_them(tmp_path, capsys):
    """An older ingest recorded --chunk-overlap -1 and then refused it: the store holds no file."""
    root = tmp_path / "store"
    open_tiny(root).close()
    settings = json.loads((root / "store.json").read_text())
    (root / "store.json").write_text(json.dumps({**settings, "chunk_overlap": -1}))
    with pytest.raises(StoreError, match="unreadable: --chunk-overlap must be in"):
        StoreConfig.load(root)
    assert main(["store", "rm", "--all", "--store", str(root)]) == 0
    assert not (root / "store.json").exists()
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0])
    store.close()
    settings = json.loads((root / "store.json").read_text())
    (root / "store.json").write_text(json.dumps({**settings, "chunk_overlap": -1}))
    assert main(["store", "rm", "--all", "--store", str(root)]) == 2  # a file was ingested with settings now lost
    assert "unreadable" in capsys.readouterr().err and (root / "store.json").exists()


def test_rm_all_waits_for_every_other_process_to_close_the_store(tmp_path, capsys):
    """A server, an ingest or an ask keeps the store's settings in memory: `rm --all` beside one left
    chunks without settings (a store nothing could open or remove) or a server chunking uploads by the
    settings just reset. It is refused while the store is open elsewhere, and works once it is not."""
    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1], kv_key="kv-of-a")
    assert main(["store", "rm", "--all", "--store", str(root)]) == 2
    assert "is open in another process" in capsys.readouterr().err
    assert store.docs.counts()["chunks"] == 2 and StoreConfig.load(root) is not None  # nothing removed
    store.close()
    assert main(["store", "rm", "--all", "--store", str(root)]) == 0
    assert "removed 1 files, 2 chunks" in capsys.readouterr().out


def test_a_model_given_as_a_relative_path_is_recorded_absolute(tmp_path, monkeypatch):
    """`ingest --model ./tiny` recorded "./tiny": the store failed from every other folder, and the
    absolute path was refused as another model. A local path is recorded absolute and matches
    however it is spelled; an alias stays as given."""
    from ragfuse.app import serving_model

    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models")
    root = tmp_path / "store"
    RagStore(root, tiny_config(model="./tiny")).close()
    where = str((tmp_path / "models" / "tiny").resolve())
    assert StoreConfig.load(root).model == where
    assert serving_model(root, "./tiny") == where
    monkeypatch.chdir(tmp_path)
    assert serving_model(root, None) == serving_model(root, where) == serving_model(root, "models/tiny") == where
    with pytest.raises(Exception, match="was ingested with model"):
        serving_model(root, "./tiny")  # no such folder here: another model
    assert tiny_config(model="smollm2-135m-instruct").model == "smollm2-135m-instruct"
