"""An open store directory: docstore, vector index and per-chunk KV store, kept consistent.

Several processes may write one store at once (two ``ragfuse ingest``, a server taking uploads):
the docstore serializes their commits, and an index is updated in place only where no other process
committed since it was loaded; otherwise it is replaced by the saved index of the docstore's current
generation, or rebuilt (``apply_changes``). Index loads and saves hold a lock file (``index.lock``),
so two writers never save over each other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from filelock import FileLock

from ragfuse.docstore import DocStore
from ragfuse.engine.kvstore import DiskTier, KVStoreError, RedisTier, TieredKVStore
from ragfuse.store_dir import StoreConfig, StoreError, ingested_store
from ragfuse.vector_index import VectorIndex

if TYPE_CHECKING:
    from ragfuse.chunk_kv import ChunkKV

DEFAULT_KV_CAPACITY_GB = 200.0
log = logging.getLogger("ragfuse.store")


@dataclass(frozen=True)
class _KeyingEngine:
    """What ``ChunkKV.key`` reads of an engine: the weights' fingerprint and the dtype it runs in."""

    fingerprint: str
    dtype: torch.dtype


class RagStore:
    def __init__(self, root: Path, config: StoreConfig, kv_capacity_gb: float = DEFAULT_KV_CAPACITY_GB,
                 redis_url: str | None = None, redis_capacity_gb: float = 4.0,
                 memory_tiers: list | None = None) -> None:
        """``memory_tiers`` (GPU/CPU pools, fastest first) sit above the disk tier: a long-running
        process keeps hot chunks there; a one-shot command needs none. A new store's settings are
        recorded last, once everything opened: a store that fails to open records none."""
        self.root = root
        self.config = config
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {root}: {exc.strerror}") from exc
        existing = StoreConfig.load(root)
        if existing is not None:
            existing.check_compatible(config)
        self._index_lock = FileLock(str(root / "index.lock"))
        self.docs = DocStore(root / "docstore.sqlite")
        try:
            tiers: list = [*(memory_tiers or []), DiskTier(root / "kv", int(kv_capacity_gb * 2**30))]
            if redis_url:
                tiers.append(RedisTier(redis_url, int(redis_capacity_gb * 2**30)))
            self.kv = TieredKVStore(tiers)
        except BaseException:
            self.docs.close()
            raise
        try:
            self.index = self._load_index()
            if existing is None:
                self._record_settings()
        except BaseException:
            self.close()
            raise

    def _record_settings(self) -> None:
        """Record a new store's settings, unless another process opening it at the same time did so
        first: then this one's must match them (two ingests starting on a new store with different
        chunk sizes would otherwise both run, and the first one's chunks sit under the second's
        settings). Under the store's write lock, which every writer takes."""
        with self._index_lock:
            recorded = StoreConfig.load(self.root)
            if recorded is None:
                self.config.save(self.root)
            else:
                recorded.check_compatible(self.config)

    @classmethod
    def open_existing(cls, root: Path, **kwargs: object) -> RagStore:
        """Open a store that must already hold an ingest (for search, stats, rm)."""
        root, config = ingested_store(root)
        return cls(root, config, **kwargs)  # type: ignore[arg-type]

    @property
    def index_path(self) -> Path:
        return self.root / "index.faiss"

    def _load_index(self) -> VectorIndex:
        """The saved index where it is at the docstore's generation, else one rebuilt from the docstore.

        A rebuilt index that cannot be saved (a full disk) is served from memory: reading needs no
        room, and the next writer's save reports the error."""
        with self._index_lock:
            saved = VectorIndex.load(self.index_path, self.config.embedding_dim, self.config.index_kind)
            if saved is not None and saved.generation == self.docs.generation:
                return saved
            index = self._build_index()
            try:
                index.save(self.index_path)
            except StoreError as exc:
                log.warning("%s", exc)
            return index

    def _build_index(self) -> VectorIndex:
        """An index of every chunk of the docstore, stamped with the generation it was read at."""
        generation, ids, vecs = self.docs.all_embeddings(self.config.embedding_dim)
        return VectorIndex.build(self.config.embedding_dim, self.config.index_kind, ids, vecs, generation)

    def current_index(self) -> VectorIndex:
        """The index, brought up to the docstore first where another process committed since it was
        loaded: a process that keeps the store open (``ragfuse serve``, the demo, a framework's
        retriever) would otherwise never find what a ``ragfuse ingest`` beside it added, and would
        lose the chunks it replaced. This process's own commits are ``apply_changes``' to bring in."""
        if not self.docs.changed_only_here(self.index.generation, self.docs.generation):
            self.index = self._load_index()
        return self.index

    def apply_changes(self, removed: list[int], added: list[int], added_vectors: np.ndarray) -> None:
        """Bring the index in line with the docstore after this store's commits since the last call
        (chunk ids ``removed``, ``added`` with their vectors), and save it.

        A flat index takes them in place when no other process committed since it was last brought
        in line; otherwise (or for IVF and HNSW) it is replaced by the saved index where another
        writer already saved the current generation, else rebuilt from the docstore. Updating in
        place over another process's commit would save an index without that process's chunks,
        stamped as current, and they would never be found again."""
        with self._index_lock:
            current = self.docs.generation
            if self.config.index_kind == "flat" and self.docs.changed_only_here(self.index.generation, current):
                # the added ids go first too: a reader's refresh (``current_index``) may have taken some
                # of these commits in already, and faiss would hold such a chunk twice
                self.index.remove(np.asarray(removed + added, dtype=np.int64))
                self.index.add(np.asarray(added, dtype=np.int64), added_vectors)
                self.index.generation = current
            else:
                saved = VectorIndex.load(self.index_path, self.config.embedding_dim, self.config.index_kind)
                if saved is not None and saved.generation == current:
                    self.index = saved
                    return
                self.index = self._build_index()
            self.index.save(self.index_path)

    def forget_kv(self, keys: Collection[str]) -> int:
        """Delete the KV entries of ``keys`` that no chunk has as its stored key any more; return how
        many. A key no tier holds costs a lookup, not a delete (a lock and a commit on disk)."""
        n = 0
        for k in set(keys) - self.docs.kv_keys_in_use(list(set(keys))):
            try:
                if self.kv.locate(k) is not None:
                    n += self.kv.delete(k)
            except KVStoreError:
                continue  # a remote tier gone away: its LRU will age the entry out
        return n

    def forget_chunk_kv(self, refs: Sequence[tuple[str | None, tuple[int, ...]]]) -> int:
        """Delete the KV of removed chunks (``(stored key, token ids)`` each, ``DocStore.kv_refs``)
        that no remaining chunk uses; return how many entries went.

        A chunk's KV is under its stored key, and under the key ``ask`` computes for it
        (``chunk_kv.py``), where KV goes when ingest stored none (``--no-kv``) or ``ask`` ran in
        another dtype. Those keys are derived here; a remaining chunk of the same tokens has the same
        ones, so they stay."""
        tokens = {t for _, t in refs}
        derived = {t: [chunk_kv.key(t) for chunk_kv in self._chunk_kvs] for t in tokens}
        in_use = {k for t in self.docs.token_ids_in_use(tokens) for k in derived[t]}
        keys = {k for k, _ in refs if k} | {k for ks in derived.values() for k in ks}
        return self.forget_kv(keys - in_use)

    @functools.cached_property
    def _chunk_kvs(self) -> list[ChunkKV]:
        """How ingest and ``ask`` key this store's chunks, once for every dtype an engine may run in
        (the store records its model and chunk KV context, not the dtype). Resolving the model reads
        its config and weights' headers, and for the instruction context its tokenizer, not its weights."""
        from ragfuse.chunk_kv import ChunkKV
        from ragfuse.engine.checkpoint import resolve
        from ragfuse.engine.errors import ModelError
        from ragfuse.engine.kvstore.entry import DTYPES
        from ragfuse.engine.llm_engine import _load_tokenizer  # the engine's loader: the prefix it tokenizes
        from ragfuse.prompt import RagPromptBuilder

        builder = None
        try:
            checkpoint = resolve(self.config.model)
            fingerprint = checkpoint.fingerprint
            if self.config.chunk_kv_context == "instruction":
                tokenizer = _load_tokenizer(checkpoint.path)
                if tokenizer is None:  # no RAG prompt can be built: neither ingest nor ask ran with it
                    return []
                builder = RagPromptBuilder(tokenizer)
        except (ModelError, OSError) as exc:
            log.warning("model %s not found (%s): KV that `ask` stored for removed chunks is left to the KV "
                        "tiers' LRU", self.config.model, exc)
            return []
        return [ChunkKV.for_context(_KeyingEngine(fingerprint, dtype), self.config.chunk_kv_context, builder)
                for dtype in DTYPES.values()]

    def remove(self, paths: list[str]) -> tuple[int, int]:
        """Remove files' chunks (and KV no longer used); return (chunks removed, KV entries removed)."""
        refs = self.docs.kv_refs(paths)
        removed = self.docs.remove_files(paths)
        self.apply_changes(removed, [], np.zeros((0, self.config.embedding_dim), np.float32))
        return len(removed), self.forget_chunk_kv(refs)

    def clear(self) -> tuple[int, int, int]:
        """Remove every file with its chunks, every entry of the store's disk KV tier (also those of
        the instruction prefix and of passages ``ask`` stored), and the settings, which the next ingest
        sets (``store rm --all``). Return (files, chunks, KV entries) removed."""
        files = [p for p, _ in self.docs.files()]
        chunks, kv = self.remove(files)
        disk = self.kv.tier("disk")
        kv += sum(disk.delete(k) for k in disk.entry_keys())
        _forget_settings(self.root)
        return len(files), chunks, kv

    @classmethod
    def clear_at(cls, root: Path) -> tuple[int, int, int]:
        """``clear`` the store at ``root``. One without settings (cleared before) or with settings no
        ingest accepts (an older version recorded an option it then refused) is cleared too where it
        holds no file: its settings were never used, and forgetting them is all there is to do."""
        try:
            config = StoreConfig.load(root)
            unreadable = None
        except StoreError as exc:
            config, unreadable = None, exc
        if config is not None:
            store = cls(root, config)
            try:
                return store.clear()
            finally:
                store.close()
        if not (root / "docstore.sqlite").is_file():
            raise unreadable or StoreError(f"no ragfuse store at {root} (run `ragfuse ingest` first, or pass --store)")
        docs = DocStore(root / "docstore.sqlite")
        try:
            held = docs.counts()["files"]
        finally:
            docs.close()
        if held:
            raise unreadable or StoreError(f"{root} holds {held} files but no settings (store.json)")
        _forget_settings(root)
        return 0, 0, 0

    def close(self) -> None:
        self.docs.close()
        self.kv.close()


def _forget_settings(root: Path) -> None:
    try:
        (root / "store.json").unlink(missing_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot remove {root / 'store.json'}: {exc.strerror}") from exc
