"""Where a ragfuse store lives and what it was built with.

A store directory holds ``docstore.sqlite`` (files, chunks, embeddings), ``index.faiss`` (derived
from the docstore, rebuilt when stale), ``kv/`` (the disk tier of per-chunk KV), ``profiles/``
(delay profiles) and ``store.json`` (the settings it was built with: later ingests must match them,
or chunks and vectors from different models would mix).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_type_hints

from ragfuse.engine.atomic_file import write_atomic
from ragfuse.engine.errors import RagfuseError


class StoreError(RagfuseError):
    """A store that is missing, unreadable, or built with other settings than those asked for."""


CHUNK_KV_CONTEXTS = ("instruction", "none")


def check_chunk_kv_context(kind: str) -> str:
    """``kind`` if it is a chunk KV context a store can record (``chunk_kv.py``), else a StoreError."""
    if kind not in CHUNK_KV_CONTEXTS:
        raise StoreError(f"chunk KV context must be one of {', '.join(CHUNK_KV_CONTEXTS)}, not {kind!r}")
    return kind


def check_chunking(chunk_tokens: int, chunk_overlap: int) -> None:
    """Refuse chunk settings no chunker can work with (``chunking.TokenChunker`` checks them here too),
    before a store records them: a store whose settings are refused by every later ingest would be stuck."""
    if chunk_tokens < 16:
        raise StoreError(f"--chunk-tokens must be at least 16, got {chunk_tokens}")
    if not 0 <= chunk_overlap < chunk_tokens:
        raise StoreError(f"--chunk-overlap must be in [0, {chunk_tokens}), got {chunk_overlap}")


def resolve_store_dir(path: str | Path | None = None) -> Path:
    """``path``, else ``$RAGFUSE_STORE``, else the per-user data directory."""
    if path:
        return Path(path).expanduser()
    if os.environ.get("RAGFUSE_STORE"):
        return Path(os.environ["RAGFUSE_STORE"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("ragfuse")) / "store"


def model_reference(model: str) -> str:
    """How a store records a model: a local path as an absolute one (``--model ./tiny`` recorded as
    typed failed from every other folder, and the absolute path was refused as another model), an
    alias or a hub id as given."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


@dataclass(frozen=True)
class StoreConfig:
    model: str  # serving model alias: its tokenizer chunks, its engine precomputes KV
    embedding_model: str
    embedding_dim: int
    index_kind: str  # flat | ivf | hnsw
    chunk_tokens: int
    chunk_overlap: int
    # what each chunk's KV is computed after (chunk_kv.py): "instruction" (the RAG prompt's prefix) or
    # "none" (alone, as CacheBlend stores it; what stores made before this setting hold)
    chunk_kv_context: str = "instruction"

    def __post_init__(self) -> None:
        """Every field of its type (``store.json`` is edited by hand, and a string where a number
        belongs would only fail deep inside a rebuild), chunk settings a chunker accepts."""
        for name, kind in get_type_hints(type(self)).items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise StoreError(f"{name} must be {kind.__name__}, not {value!r}")
        for name in ("model", "embedding_model"):
            object.__setattr__(self, name, model_reference(getattr(self, name)))
        if self.embedding_dim < 1:
            raise StoreError(f"embedding_dim must be at least 1, not {self.embedding_dim}")
        check_chunking(self.chunk_tokens, self.chunk_overlap)
        check_chunk_kv_context(self.chunk_kv_context)

    def save(self, root: Path) -> None:
        try:
            write_atomic(root / "store.json", json.dumps(asdict(self), indent=2))
        except OSError as exc:
            raise StoreError(f"cannot record the store's settings in {root / 'store.json'}: {exc.strerror}") from exc

    @classmethod
    def load(cls, root: Path) -> StoreConfig | None:
        path = root / "store.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            data.setdefault("chunk_kv_context", "none")  # written before the setting: its chunks' KV is alone
            return cls(**data)
        except OSError as exc:  # e.g. a directory where the file belongs
            raise StoreError(f"{path} is unreadable: {exc.strerror or exc}") from exc
        except (ValueError, TypeError, AttributeError, StoreError) as exc:
            raise StoreError(f"{path} is unreadable: {exc}") from exc

    def check_compatible(self, other: StoreConfig) -> None:
        """Refuse to mix chunkings, models or embeddings in one store."""
        diffs = [f"{k}: store has {v!r}, asked {getattr(other, k)!r}" for k, v in asdict(self).items()
                 if getattr(other, k) != v]
        if diffs:
            raise StoreError("this store was built with other settings (" + "; ".join(diffs)
                             + "); use another --store or `ragfuse store rm --all` first")


def ingested_store(path: str | Path | None) -> tuple[Path, StoreConfig]:
    """The store directory for ``path`` and its settings; a user error where nothing was ingested."""
    root = resolve_store_dir(path)
    config = StoreConfig.load(root)
    if config is None:
        raise StoreError(f"no ragfuse store at {root} (run `ragfuse ingest` first, or pass --store)")
    return root, config
