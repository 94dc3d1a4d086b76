"""Damaged store files: a one-line error naming the file, never a traceback; the KV manifest, only an
index of the entry files, is set aside and rebuilt from them."""

from __future__ import annotations

import json
import shutil

import pytest

from ragfuse.cli import main
from ragfuse.rag_store import RagStore
from tests.tiny_store import add_file, open_tiny, put_kv


@pytest.fixture(scope="module")
def good_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("good") / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0, 1], kv_key="kv-a")
    add_file(store, "/docs/b.txt", [2], kv_key="kv-b")
    put_kv(store, "kv-a")
    put_kv(store, "kv-b", num_tokens=5)
    store.close()
    return root


def _garbage(path):
    path.write_bytes(bytes(range(256)) * 16)


def _truncate(path):
    with path.open("r+b") as f:
        f.truncate(3000)


def _retype(path):
    settings = json.loads(path.read_text())
    path.write_text(json.dumps({**settings, "embedding_dim": str(settings["embedding_dim"])}))


def _directory(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(("name", "damage", "says"), [
    ("docstore.sqlite", _garbage, "cannot open the docstore {path}: file is not a database"),
    ("docstore.sqlite", _truncate, "cannot open the docstore {path}: database disk image is malformed"),
    ("store.json", _retype, "{path} is unreadable: embedding_dim must be int, not '4'"),
    ("store.json", _directory, "{path} is unreadable: Is a directory"),
])
def test_a_damaged_store_file_is_a_one_line_error_naming_it(tmp_path, capsys, good_store, name, damage, says):
    root = tmp_path / "store"
    shutil.copytree(good_store, root)
    damage(root / name)
    for args in (["store", "stats"], ["search", "anything"], ["store", "rm", "/docs/a.txt"]):
        assert main([*args, "--store", str(root)]) == 2
        assert capsys.readouterr().err == f"ragfuse: error: {says.format(path=root / name)}\n"


def test_a_damaged_kv_manifest_is_set_aside_and_rebuilt_from_the_entry_files(tmp_path, capsys, good_store):
    root = tmp_path / "store"
    shutil.copytree(good_store, root)
    _garbage(root / "kv" / "manifest.sqlite")
    assert main(["store", "stats", "--store", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"]["disk"]["entries"] == 2
    (aside,) = (root / "kv").glob("manifest.sqlite.corrupt-*")
    assert aside.read_bytes() == bytes(range(256)) * 16
    store = RagStore.open_existing(root)
    assert store.kv.get("kv-a").meta.num_tokens == 3 and store.kv.get("kv-b").meta.num_tokens == 5
    assert store.remove(["/docs/a.txt"]) == (2, 1) and store.kv.locate("kv-a") is None
    store.close()
