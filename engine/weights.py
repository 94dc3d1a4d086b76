"""Reading HF checkpoints' tensors (safetensors, or pickled PyTorch weights) into an engine model."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from .checkpoint import weight_files, weight_map
from .errors import ModelError

if TYPE_CHECKING:  # the models import the config, which imports this module
    from .models import LlamaForCausalLM


def iter_checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the checkpoint's weights files (``weight_files``). A file cut
    short (an interrupted download), empty, damaged or holding other objects than tensors is a
    ModelError naming it."""
    for f in weight_files(path):
        if f.suffix == ".safetensors":
            yield from _iter_safetensors(f)
        else:
            yield from _load_pickled(f).items()


def stored_tensor_names(path: Path) -> set[str]:
    """The names of the tensors the checkpoint stores, from its shard index or its one file's
    header (a pickled file is mapped, not read), without loading the tensors."""
    mapping = weight_map(path)
    if mapping is not None:
        return set(mapping)
    (f,) = weight_files(path)
    if f.suffix != ".safetensors":
        return set(_load_pickled(f))
    try:
        with safe_open(str(f), framework="pt") as fh:
            return set(fh.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"cannot read weights file {f}: {exc}; fetch or save it again") from exc


def _iter_safetensors(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, fh.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"cannot read weights file {f}: {exc}; fetch or save it again") from exc


def _load_pickled(f: Path) -> dict[str, torch.Tensor]:
    """The state dict in a ``torch.save`` file, with ``weights_only`` so that unpickling runs no code
    from the file (only tensors and plain containers are rebuilt). Files in torch's zip format (all
    since torch 1.6) are memory-mapped: their tensors are read from disk as they are copied into the
    model, never a second full copy in memory; older files are read whole."""
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(f))
    except pickle.UnpicklingError as exc:  # an object weights_only refuses to rebuild; torch's message runs
        # to many lines of advice that would run the file's code: keep the line that names the object
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
        raise ModelError(f"weights file {f} holds objects other than tensors, which ragfuse does not unpickle "
                         f"({reason}); save the model as safetensors") from exc
    except Exception as exc:  # torch.load fails on damaged files with whatever error its reader hits
        # (RuntimeError for a cut zip, EOFError for an empty file, KeyError for random bytes)
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelError(f"cannot read weights file {f}: {detail}; fetch or save it again") from exc
    if not isinstance(state, dict):
        raise ModelError(f"weights file {f} holds a {type(state).__name__}, not a state dict of named tensors")
    odd = next(((k, v) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise ModelError(f"weights file {f} is not a state dict of named tensors: its entry {odd[0]!r} is a "
                         f"{type(odd[1]).__name__}")
    return state


def load_checkpoint_weights(model: LlamaForCausalLM, path: Path) -> None:
    try:
        model.load_weights(iter_checkpoint_tensors(path))
    except KeyError as exc:
        raise ModelError(f"checkpoint {path} does not match its config: {exc.args[0]}") from exc
