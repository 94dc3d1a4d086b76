"""The connector's settings (from vLLM's ``kv_connector_extra_config``) and its per-process store.

Settings are plain data so the backend can build them without importing vLLM, and the same dict
reaches the scheduler and every worker process through vLLM's config.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragfuse.engine.checkpoint import Checkpoint, cache_root
from ragfuse.engine.errors import RagfuseError
from ragfuse.engine.kvstore import DiskTier, MemoryTier, TieredKVStore
from ragfuse.engine.kvstore.entry import DTYPES

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class SettingsError(RagfuseError, ValueError):
    """Bad connector settings, reported when vLLM starts (a ``ValueError`` too, as vLLM's own config
    checks raise), instead of a crash inside the scheduler at the first request."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_dtype`` is the dtype entries are stored (and keyed) in. float32 by default, also where vLLM
    computes in bf16 (``compute_dtype``): bf16 K un-rotated and re-rotated in float32 rounds back to the very same bf16
    value, so session reloads are bit-exact, and ragfuse's own CPU engine (float32) writes keys the
    connector finds. ``bfloat16`` halves the bytes and matches a bf16 GPU engine's keys, at the cost
    of one bf16 rounding of re-rotated K."""

    store_dir: str
    fingerprint: str
    kv_dtype_name: str = "float32"
    span_tokens: int = 128
    memory_mb: int = 1024
    disk_gb: float = 8.0

    def __post_init__(self) -> None:
        """Check every value here: settings arrive as JSON from a command line, and a bad one would
        otherwise surface only at the first request, inside vLLM's scheduler, and stop the engine."""
        for name in ("store_dir", "fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise SettingsError(f"ragfuse connector: {name} must be a non-empty string, got {value!r}")
        if self.kv_dtype_name not in DTYPES:
            raise SettingsError(f"ragfuse connector: kv_dtype_name must be one of {sorted(DTYPES)}, "
                                f"got {self.kv_dtype_name!r}")
        if not _is_int(self.span_tokens) or self.span_tokens <= 0:
            raise SettingsError(f"ragfuse connector: span_tokens must be a positive integer, got {self.span_tokens!r}")
        if not _is_int(self.memory_mb) or self.memory_mb < 0:
            raise SettingsError(f"ragfuse connector: memory_mb must be an integer >= 0 (0: no memory tier), "
                                f"got {self.memory_mb!r}")
        if not (_is_int(self.disk_gb) or isinstance(self.disk_gb, float)) or not self.disk_gb > 0:
            raise SettingsError(f"ragfuse connector: disk_gb must be a number > 0, got {self.disk_gb!r}")

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype_name]

    def to_extra_config(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_model(cls, model_dir: str | Path, store_dir: str | Path | None = None, **kwargs: Any) -> ConnectorSettings:
        """Settings for a local safetensors model directory; the fingerprint is ragfuse's own, so keys
        match what ``ragfuse ingest`` and the engine store for the same weights."""
        fingerprint = Checkpoint(name=Path(model_dir).name, path=Path(model_dir)).fingerprint
        store = Path(store_dir) if store_dir is not None else cache_root() / "vllm-kv"
        return cls(store_dir=str(store), fingerprint=fingerprint, **kwargs)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config``, checked at start-up; without a fingerprint the
        model must be a local directory (the fingerprint is computed from it)."""
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise SettingsError(f"ragfuse connector: unknown kv_connector_extra_config keys {unknown}; "
                                f"known: {sorted(known)}")
        if "fingerprint" in extra:
            if "store_dir" not in extra:
                raise SettingsError("ragfuse connector: kv_connector_extra_config needs 'store_dir'")
            return cls(**extra)
        model = Path(vllm_config.model_config.model)
        if not (model / "config.json").is_file():
            raise SettingsError("ragfuse connector: give kv_connector_extra_config['fingerprint'] for a model "
                                "that is not a local directory")
        return cls.for_model(model, **extra)


class SpanState(Enum):
    """Where a span's entry stands for the scheduler: loadable, being written, or absent."""

    STORED = "stored"
    SAVING = "saving"
    MISSING = "missing"


class PendingSaves:
    """Marks, visible across processes, for entries a worker is still writing.

    vLLM runs the scheduler and the workers in different processes, and saves are written on a
    background thread, so a follow-up request can be scheduled before its history reaches the
    store. The worker writes ``pending/<key>`` before queueing a save and removes it once the entry
    is stored; the scheduler defers a request whose next span is marked instead of recomputing it.
    A mark names the process that wrote it (host and process id; the scheduler's): a mark whose
    process is gone (an engine restarted after a crash, finding its predecessor's marks) is ignored
    at once, so requests are not held back for saves that will never end; a mark older than
    ``stale_s`` is ignored whoever wrote it (a worker killed mid-save under a live scheduler, a
    writer on another host, whose process cannot be checked from here).
    """

    def __init__(self, root: str | Path, stale_s: float = 60.0) -> None:
        self.dir = Path(root) / "pending"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SettingsError(f"ragfuse connector: cannot create the store directory {self.dir}: {exc}") from exc
        self.stale_s = stale_s

    def mark(self, key: str) -> bool:
        """Mark ``key`` as being saved; False where the mark cannot be written (disk full, folder made
        read-only): the caller then skips that save, a future miss, rather than stopping the engine.
        A half-written mark is removed, so it cannot hold requests back."""
        path = self.dir / key
        try:
            path.write_text(f"{socket.gethostname()} {os.getpid()}")
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return False
        return True

    def clear(self, key: str) -> None:
        (self.dir / key).unlink(missing_ok=True)

    def is_pending(self, key: str) -> bool:
        path = self.dir / key
        try:
            age = time.time() - path.stat().st_mtime
            writer = path.read_text()
        except FileNotFoundError:
            return False
        return age < self.stale_s and _writer_alive(writer)

    def lookup(self, key: str, stored: Callable[[str], bool]) -> SpanState:
        """Whether ``key`` is stored, still being saved, or missing, as ``stored`` (the store's
        lookup) and the marks say together.

        A writer stores the entry before it clears the mark, so "not stored, then not marked" can
        straddle a save that ended between the two checks: the entry is looked up once more before
        it is called missing, or a follow-up request would recompute what was just saved.
        """
        if stored(key):
            return SpanState.STORED
        if self.is_pending(key):
            return SpanState.SAVING
        return SpanState.STORED if stored(key) else SpanState.MISSING


def _writer_alive(writer: str) -> bool:
    """Whether the process a mark names may still be writing: False only for a process of this host
    that no longer exists (a mark still being written, or from another host, counts as alive)."""
    host, _, pid = writer.rpartition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


_STORES: dict[ConnectorSettings, TieredKVStore] = {}
_STORE_USERS: dict[ConnectorSettings, int] = {}
_STORES_LOCK = threading.Lock()


def shared_store(settings: ConnectorSettings) -> TieredKVStore:
    """One store per process and settings: the scheduler and worker connectors of one engine process
    share its memory tier; other processes (tensor-parallel workers) share the disk tier. Each call
    must be paired with ``release_store`` (the connector's ``shutdown``)."""
    with _STORES_LOCK:
        store = _STORES.get(settings)
        if store is None:
            root = Path(settings.store_dir)
            memory = [MemoryTier("cpu", "cpu", settings.memory_mb << 20, pin=False)] if settings.memory_mb > 0 else []
            store = TieredKVStore([*memory, DiskTier(root, int(settings.disk_gb * 2**30))])
            _STORES[settings] = store
        _STORE_USERS[settings] = _STORE_USERS.get(settings, 0) + 1
        return store


def release_store(settings: ConnectorSettings) -> None:
    """Drop one user of the shared store; the last closes it and forgets it. Without this, an engine
    run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) left its store behind when shut down: the
    manifest's open files under the store folder and up to ``memory_mb`` of cached KV, for the life
    of the process."""
    with _STORES_LOCK:
        users = _STORE_USERS.get(settings, 0) - 1
        if users > 0:
            _STORE_USERS[settings] = users
            return
        _STORE_USERS.pop(settings, None)
        store = _STORES.pop(settings, None)
    if store is not None:
        store.close()
