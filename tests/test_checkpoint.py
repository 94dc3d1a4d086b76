"""The checkpoint fingerprint, the key of all stored KV, follows the weights' bytes: a model changed in
place at the same shapes and file size gets a new one (its old KV is never served), an unchanged one
keeps it across runs, and each file's digest is hashed once and read back from the cache after."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ragfuse.engine.checkpoint import Checkpoint, _gguf_cache_dir, content_digest, resolve
from ragfuse.engine.errors import ModelError

HOUR_NS = 3600 * 10**9


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RAGFUSE_CACHE", str(root))
    return root


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny random checkpoint (config.json and model.safetensors, as transformers saves them),
    written an hour ago, as a model loaded again at a later start was."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (64, 32), "model.norm.weight": (32,)}
    for i in range(2):
        shapes |= {f"model.layers.{i}.self_attn.v_proj.weight": (16, 32),
                   f"model.layers.{i}.mlp.up_proj.weight": (64, 32)}
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                                                  "num_hidden_layers": 2, "vocab_size": 64}))
    weights = path / "model.safetensors"
    save_file({name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}, str(weights))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns - HOUR_NS))
    return path


def _edit_one_weight(weights: Path, name: str, keep_mtime: bool = False) -> None:
    """Change the first value of tensor ``name`` in place: same header, same size (a retrain in place);
    with ``keep_mtime`` the writer then puts the old modification time back."""
    before = weights.stat()
    with weights.open("r+b") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        start = 8 + header_len + json.loads(fh.read(header_len))[name]["data_offsets"][0]
        fh.seek(start)
        (value,) = struct.unpack("<f", fh.read(4))
        fh.seek(start)
        fh.write(struct.pack("<f", value * 1.5 + 0.25))
    if keep_mtime:
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size


def _fingerprint(path: Path) -> str:
    return Checkpoint(name=path.name, path=path).fingerprint  # a fresh object: another run's


def test_fingerprint_changes_when_one_weight_changes_in_place(model_dir, cache):
    weights = model_dir / "model.safetensors"
    first = _fingerprint(model_dir)
    assert resolve(str(model_dir)).fingerprint == first
    _edit_one_weight(weights, "model.layers.0.self_attn.v_proj.weight")
    second = _fingerprint(model_dir)
    assert second != first
    _edit_one_weight(weights, "model.layers.1.mlp.up_proj.weight", keep_mtime=True)
    assert _fingerprint(model_dir) not in (first, second)


def test_fingerprint_of_an_unchanged_checkpoint_is_stable(model_dir, cache, tmp_path):
    first = _fingerprint(model_dir)
    assert _fingerprint(model_dir) == first  # read back from the digest cache
    for record in (cache / "digests").iterdir():
        record.unlink()
    assert _fingerprint(model_dir) == first  # hashed from the bytes again: the same
    moved = tmp_path / "elsewhere"
    model_dir.rename(moved)
    assert _fingerprint(moved) == first  # the weights' identity, not their place


def test_digest_is_hashed_once_then_read_from_the_cache(model_dir, cache):
    weights = model_dir / "model.safetensors"
    digest = content_digest(weights)
    (record,) = (cache / "digests").iterdir()
    assert record.read_text() == digest
    record.write_text("0" * 32)  # what a later call returns is the record's, so it did not hash again
    assert content_digest(weights) == "0" * 32
    record.write_bytes(b"\xff torn")  # an unreadable record: the file is hashed again, the record rewritten
    assert content_digest(weights) == digest and record.read_text() == digest


def test_a_file_written_just_now_is_not_cached(model_dir, cache):
    """Its timestamp may not move if it is written again within the same clock tick, so a record
    of it could outlive its contents."""
    weights = model_dir / "model.safetensors"
    _edit_one_weight(weights, "model.norm.weight")
    content_digest(weights)
    assert not (cache / "digests").exists()


def test_gguf_is_converted_again_when_its_bytes_change(tmp_path, cache):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(os.urandom(1 << 16))
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns - HOUR_NS))
    first = _gguf_cache_dir(gguf)
    assert first.parent == cache / "models" and first.name.startswith("tiny-")
    mtime = gguf.stat().st_mtime_ns
    with gguf.open("r+b") as fh:
        fh.seek(1000)
        fh.write(b"\x00\x01")
    os.utime(gguf, ns=(0, mtime))  # same path, size and mtime: only the bytes say it changed
    assert _gguf_cache_dir(gguf) != first


def test_unreadable_weights_are_a_model_error(tmp_path, cache):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(ModelError, match="cannot read weights file .*model.safetensors"):
        _fingerprint(tmp_path)
