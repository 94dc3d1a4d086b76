"""An open store directory: docstore, vector index and per-chunk KV store, kept consistent."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ragfuse.docstore import DocStore
from ragfuse.engine.kvstore import DiskTier, KVStoreError, RedisTier, TieredKVStore
from ragfuse.store_dir import StoreConfig, StoreError, ingested_store
from ragfuse.vector_index import VectorIndex

DEFAULT_KV_CAPACITY_GB = 200.0


class RagStore:
    def __init__(self, root: Path, config: StoreConfig, kv_capacity_gb: float = DEFAULT_KV_CAPACITY_GB,
                 redis_url: str | None = None, redis_capacity_gb: float = 4.0,
                 memory_tiers: list | None = None) -> None:
        """``memory_tiers`` (GPU/CPU pools, fastest first) sit above the disk tier: a long-running
        process keeps hot chunks there; a one-shot command needs none."""
        self.root = root
        self.config = config
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {root}: {exc.strerror}") from exc
        existing = StoreConfig.load(root)
        if existing is not None:
            existing.check_compatible(config)
        else:
            config.save(root)
        self.docs = DocStore(root / "docstore.sqlite")
        self.index = self._load_index()
        tiers: list = [*(memory_tiers or []), DiskTier(root / "kv", int(kv_capacity_gb * 2**30))]
        if redis_url:
            tiers.append(RedisTier(redis_url, int(redis_capacity_gb * 2**30)))
        self.kv = TieredKVStore(tiers)

    @classmethod
    def open_existing(cls, root: Path, **kwargs: object) -> RagStore:
        """Open a store that must already hold an ingest (for search, stats, rm)."""
        root, config = ingested_store(root)
        return cls(root, config, **kwargs)  # type: ignore[arg-type]

    @property
    def index_path(self) -> Path:
        return self.root / "index.faiss"

    def _load_index(self) -> VectorIndex:
        cfg = self.config
        idx = VectorIndex.load(self.index_path, cfg.embedding_dim, cfg.index_kind, self.docs.generation)
        return idx if idx is not None else self.rebuild_index()

    def rebuild_index(self) -> VectorIndex:
        ids, vecs = self.docs.all_embeddings(self.config.embedding_dim)
        self.index = VectorIndex.build(self.config.embedding_dim, self.config.index_kind, ids, vecs)
        self.index.save(self.index_path, self.docs.generation)
        return self.index

    def apply_changes(self, removed: list[int], added: list[int], added_vectors: np.ndarray) -> None:
        """Bring the index in line with the docstore after chunks were replaced, and save it."""
        if self.config.index_kind == "flat":
            self.index.remove(np.asarray(removed, dtype=np.int64))
            self.index.add(np.asarray(added, dtype=np.int64), added_vectors)
            self.index.save(self.index_path, self.docs.generation)
        else:
            self.rebuild_index()

    def forget_kv(self, keys: list[str]) -> int:
        """Delete the KV entries of ``keys`` that no chunk uses any more; return how many."""
        unused = set(keys) - self.docs.kv_keys_in_use(keys)
        n = 0
        for k in unused:
            try:
                n += self.kv.delete(k)
            except KVStoreError:
                continue  # a remote tier gone away: its LRU will age the entry out
        return n

    def remove(self, paths: list[str]) -> tuple[int, int]:
        """Remove files' chunks (and KV no longer used); return (chunks removed, KV entries removed)."""
        ids = [i for p in paths for i in self.docs.chunk_ids(p)]
        keys = [c.kv_key for c in self.docs.chunks(ids).values() if c.kv_key]
        removed = self.docs.remove_files(paths)
        self.apply_changes(removed, [], np.zeros((0, self.config.embedding_dim), np.float32))
        return len(removed), self.forget_kv(keys)

    def close(self) -> None:
        self.docs.close()
        self.kv.close()
