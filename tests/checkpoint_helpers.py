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
