"""Tiny random-weight checkpoints saved by transformers, and a CPU engine over one: what the
checkpoint and model-family tests compare the engine against."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ragfuse.engine import EngineConfig, LLMEngine


def save_edited(path: Path, model: torch.nn.Module, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """``model`` saved by transformers into ``path``, its config.json then edited as a user might
    (``edit`` changes the parsed dict in place)."""
    model.eval().save_pretrained(path)
    if edit is not None:
        file = path / "config.json"
        raw = json.loads(file.read_text())
        edit(raw)
        file.write_text(json.dumps(raw))
    return path


def tiny_engine(path: Path) -> LLMEngine:
    """A CPU engine over the checkpoint in ``path``, with small blocks and a 16 MiB KV cache."""
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))


def to_pickled(path: Path, shards: int) -> None:
    """Replace the folder's safetensors with the pickled layout transformers wrote before safetensors
    (and still reads): ``pytorch_model.bin``, or numbered shards and ``pytorch_model.bin.index.json``."""
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    if shards == 1:
        torch.save(tensors, path / "pytorch_model.bin")
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: tensors[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
