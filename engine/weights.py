"""Reading HF safetensors checkpoints into an engine model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .checkpoint import weight_files
from .errors import ModelError
from .models import LlamaForCausalLM


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the checkpoint's weights files (``weight_files``). A file cut
    short (an interrupted download), empty or damaged is a ModelError naming it."""
    for f in weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, fh.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelError(f"cannot read weights file {f}: {exc}; fetch or save it again") from exc


def load_checkpoint_weights(model: LlamaForCausalLM, path: Path) -> None:
    try:
        model.load_weights(iter_safetensors(path))
    except KeyError as exc:
        raise ModelError(f"checkpoint {path} does not match its config: {exc.args[0]}") from exc
