"""Stores without a model: chunks with chosen vectors put straight into the docstore, for tests of
the store's own machinery (index, removal, settings, damaged files) that need no embedder or engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ragfuse.docstore import NewChunk
from ragfuse.engine.kvstore import StoredKV
from ragfuse.rag_store import RagStore
from ragfuse.store_dir import StoreConfig

DIM = 4


def tiny_config(**changes: object) -> StoreConfig:
    """Settings of a 4-dimensional store; chunk KV computed alone, so removing chunks needs the
    default model's fingerprint (its headers) but no tokenizer."""
    fields = dict(model="smollm2-135m-instruct", embedding_model="tiny", embedding_dim=DIM, index_kind="flat",
                  chunk_tokens=512, chunk_overlap=0, chunk_kv_context="none")
    return StoreConfig(**{**fields, **changes})  # type: ignore[arg-type]


def unit(i: int, dim: int = DIM) -> np.ndarray:
    """The ``i``-th axis: chunks with different axes never look alike to a search."""
    v = np.zeros(dim, np.float32)
    v[i % dim] = 1.0
    return v


def add_file(store: RagStore, path: str, axes: list[int], kv_key: str | None = None) -> list[int]:
    """Commit ``path`` with one chunk per axis (tokens: its axis) and bring the index in line, as an
    ingest does; return the new chunk ids."""
    vectors = np.stack([unit(i, store.config.embedding_dim) for i in axes])
    chunks = [NewChunk(path, f"chunk {i} of {path}", (i + 1,), kv_key, v) for i, v in zip(axes, vectors)]
    removed, added = store.docs.replace_file(path, f"hash of {path}", chunks)
    store.apply_changes(removed, added, vectors)
    return added


def put_kv(store: RagStore, key: str, num_tokens: int = 3) -> None:
    """A small real KV entry under ``key`` (2 layers, 1 head of 8)."""
    k, v = torch.randn(2, num_tokens, 1, 8), torch.randn(2, num_tokens, 1, 8)
    store.kv.put(StoredKV.from_kv(key, k, v))


def open_tiny(root: Path) -> RagStore:
    return RagStore(root, tiny_config())
