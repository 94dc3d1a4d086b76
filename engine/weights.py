"""Reading HF safetensors checkpoints into an engine model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import ModelError
from .models import LlamaForCausalLM


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, fh.get_tensor(name)


def load_checkpoint_weights(model: LlamaForCausalLM, path: Path) -> None:
    try:
        model.load_weights(iter_safetensors(path))
    except KeyError as exc:
        raise ModelError(f"checkpoint {path} does not match its config: {exc.args[0]}") from exc
