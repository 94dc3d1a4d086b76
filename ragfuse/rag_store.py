"""An open store directory: docstore, vector index and per-chunk KV store, kept consistent.

Several processes may write one store at once (two ``ragfuse ingest``, a server taking uploads):
the docstore serializes their commits, and an index is updated in place only where no other process
committed since it was loaded; otherwise it is replaced by the saved index of the docstore's current
generation, or rebuilt (``apply_changes``). Index loads and saves hold a lock file (``index.lock``),
so two writers never save over each other.

An ingest holds ``ingest.lock`` shared from its first KV write to its commit (``ingesting``): until
then no chunk references its new entries, and ``gc``, which removes entries no chunk references,
takes it exclusively.

A store this process cannot write (a read-only mount, a folder of another user's) opens read-only:
search and ``ask`` read it as it is (KV computed on a miss stays in memory tiers), and every command
that would change it (an ingest, an upload, ``store rm``, ``gc``) is refused with a StoreError.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import uuid
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm

from ragfuse.docstore import DocStore
from ragfuse.engine.folder_lock import FolderBusyError, FolderLock
from ragfuse.engine.kvstore import DiskTier, KVStoreError, RedisTier, TieredKVStore, kv_key
from ragfuse.engine.kvstore.disk import untouched_for
from ragfuse.store_dir import StoreConfig, StoreError, ingested_store
from ragfuse.vector_index import VectorIndex

if TYPE_CHECKING:
    from ragfuse.chunk_kv import ChunkKV
    from ragfuse.prompt import RagPromptBuilder

DEFAULT_KV_CAPACITY_GB = 200.0
# a temp file untouched this long is a dead writer's: every writer (a KV put, ``write_atomic``, an index
# save) writes its temp file in one go and renames it at once
DEAD_TEMP_AGE_S = 3600.0
log = logging.getLogger("ragfuse.store")


@dataclass(frozen=True)
class _KeyingEngine:
    """What ``ChunkKV.key`` reads of an engine: the weights' fingerprint and the dtype it runs in."""

    fingerprint: str
    dtype: torch.dtype


@dataclass
class TierGc:
    """What ``RagStore.gc`` removed (or, in a dry run, would remove) from one persistent KV tier."""

    unreferenced_entries: int = 0
    unreferenced_bytes: int = 0
    corrupt_entries: list[str] = field(default_factory=list)  # keys failing their checksum (``verify``)
    corrupt_bytes: int = 0
    verified_entries: int = 0

    @property
    def bytes(self) -> int:
        return self.unreferenced_bytes + self.corrupt_bytes


@dataclass(kw_only=True)
class GcReport(TierGc):
    """What ``RagStore.gc`` removed (or, in a dry run, would remove). The disk tier's part is the
    report's own fields (as before gc covered Redis: a script reading them reads the same); the Redis
    tier's is ``redis``, None where the store was opened without one."""

    dry_run: bool
    leftover_files: list[str] = field(default_factory=list)  # crash leftovers, relative to the store
    leftover_bytes: int = 0
    redis: TierGc | None = None

    @property
    def bytes(self) -> int:
        return super().bytes + self.leftover_bytes + (self.redis.bytes if self.redis is not None else 0)


class _CollectableTier(Protocol):
    """What ``gc`` uses of a persistent tier (``DiskTier``, ``RedisTier``)."""

    name: str

    def entry_sizes(self) -> dict[str, int]: ...

    def intact(self, key: str) -> bool | None: ...

    def drop(self, key: str) -> None: ...

    def delete(self, key: str) -> bool: ...


class RagStore:
    def __init__(self, root: Path, config: StoreConfig, kv_capacity_gb: float = DEFAULT_KV_CAPACITY_GB,
                 redis_url: str | None = None, redis_capacity_gb: float = 4.0,
                 memory_tiers: list | None = None, sweep_kv: bool = True) -> None:
        """``memory_tiers`` (GPU/CPU pools, fastest first) sit above the disk tier: a long-running
        process keeps hot chunks there; a one-shot command needs none. A new store's settings are
        recorded last, once everything opened: a store that fails to open records none.
        ``sweep_kv=False``: leave crash leftovers in the disk tier to ``gc``, which reports them."""
        self.root = root
        self.config = config
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {root}: {exc.strerror}") from exc
        # shared with every process that has the store open; ``clear`` needs it alone (waits for one)
        self._open = FolderLock(root / "open.lock", exclusive=False, busy="", wait=True)
        self.read_only = not self._open.writable
        try:
            existing = StoreConfig.load(root)
            if existing is not None:
                existing.check_compatible(config)
            elif self.read_only:
                raise StoreError(f"the store folder {root} is read-only and holds no ingest: there is no store to "
                                 "read, and none can be made there")
            self._index_lock = FileLock(str(root / "index.lock")) if not self.read_only else None
            self.docs = DocStore(root / "docstore.sqlite", read_only=self.read_only)
        except BaseException:
            self._open.release()
            raise
        try:
            tiers: list = [*(memory_tiers or []), DiskTier(root / "kv", int(kv_capacity_gb * 2**30),
                                                           sweep=sweep_kv, read_only=self.read_only)]
            if redis_url:
                namespace = (_recorded_redis_namespace(root) if self.read_only
                             else _redis_namespace(root, self._index_locked()))
                tiers.append(RedisTier(redis_url, int(redis_capacity_gb * 2**30), prefix=namespace))
            self.kv = TieredKVStore(tiers)
        except BaseException:
            self.docs.close()
            self._open.release()
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
        with self._index_locked():
            recorded = StoreConfig.load(self.root)
            if recorded is None:
                self.config.save(self.root)
            else:
                recorded.check_compatible(self.config)

    def _index_locked(self) -> contextlib.AbstractContextManager[object]:
        """The index lock, held around index loads and saves and the settings' first record. A
        read-only store takes it shared through a read-only descriptor: a writer behind a read-only
        bind of a live store holds it while it saves, and a reader waits for a whole index."""
        if self._index_lock is not None:
            return self._index_lock
        return _held(self.root / "index.lock")

    def check_writable(self, what: str) -> None:
        """Refuse ``what`` (a command or request that changes the store) on a read-only store."""
        if self.read_only:
            raise StoreError(_read_only(self.root, what))

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
        room, and the next writer's save reports the error; a read-only store's is not saved at all."""
        with self._index_locked():
            saved = VectorIndex.load(self.index_path, self.config.embedding_dim, self.config.index_kind)
            if saved is not None and saved.generation == self.docs.generation:
                return saved
            index = self._build_index()
            if not self.read_only:
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
        self.check_writable("an ingest")
        with self._index_locked():
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
        ones, so they stay.

        While an ingest runs (another process's, or a server's upload) nothing is deleted: it may
        have counted this KV as stored for chunks it has not committed yet; ``gc`` removes it later."""
        if not refs:
            return 0
        try:
            with _held(self.root / "ingest.lock", busy="an ingest is running"):
                tokens = {t for _, t in refs}
                derived = {t: [chunk_kv.key(t) for chunk_kv in self._chunk_kvs] for t in tokens}
                in_use = {k for t in self.docs.token_ids_in_use(tokens) for k in derived[t]}
                keys = {k for k, _ in refs if k} | {k for ks in derived.values() for k in ks}
                return self.forget_kv(keys - in_use)
        except FolderBusyError as exc:
            log.info("KV of %d removed chunks kept for `ragfuse store gc`: %s", len(refs), exc)
            return 0

    @functools.cache  # noqa: B019 - one per store, which lives as long as its process uses it
    def _keying(self) -> tuple[str, RagPromptBuilder | None]:
        """The store model's fingerprint and RAG prompt builder (None: the model has no tokenizer, so
        no RAG prompt was ever built with it): what ingest and ``ask`` key the store's KV by. Reads the
        model's config, its weights' headers and its tokenizer, not its weights. Raises ModelError or
        OSError where the model is not found."""
        from ragfuse.engine.checkpoint import resolve
        from ragfuse.engine.llm_engine import _load_tokenizer  # the engine's loader: the prefix it tokenizes
        from ragfuse.prompt import RagPromptBuilder

        checkpoint = resolve(self.config.model)
        tokenizer = _load_tokenizer(checkpoint.path)
        return checkpoint.fingerprint, RagPromptBuilder(tokenizer) if tokenizer is not None else None

    @functools.cached_property
    def _chunk_kvs(self) -> list[ChunkKV]:
        """How ingest and ``ask`` key this store's chunks, once for every dtype an engine may run in
        (the store records its model and chunk KV context, not the dtype); none where the model is not
        found (with a warning) or an instruction context cannot be built."""
        from ragfuse.chunk_kv import ChunkKV
        from ragfuse.engine.errors import ModelError
        from ragfuse.engine.kvstore.entry import DTYPES

        try:
            fingerprint, builder = self._keying()
        except (ModelError, OSError) as exc:
            log.warning("model %s not found (%s): KV that `ask` stored for removed chunks is left to the KV "
                        "tiers' LRU", self.config.model, exc)
            return []
        if self.config.chunk_kv_context == "instruction" and builder is None:
            return []  # neither ingest nor ask ran with it
        return [ChunkKV.for_context(_KeyingEngine(fingerprint, dtype), self.config.chunk_kv_context, builder)
                for dtype in DTYPES.values()]

    def remove(self, paths: list[str]) -> tuple[int, int]:
        """Remove files' chunks (and KV no longer used); return (chunks removed, KV entries removed)."""
        self.check_writable("`ragfuse store rm`")
        refs = self.docs.kv_refs(paths)
        removed = self.docs.remove_files(paths)
        self.apply_changes(removed, [], np.zeros((0, self.config.embedding_dim), np.float32))
        return len(removed), self.forget_chunk_kv(refs)

    def clear(self) -> tuple[int, int, int]:
        """Remove every file with its chunks, every entry of the store's disk KV tier (also those of
        the instruction prefix and of passages ``ask`` stored), and the settings, which the next ingest
        sets (``store rm --all``). Return (files, chunks, KV entries) removed."""
        self.check_writable("`ragfuse store rm --all`")
        self._open.exclusive(
            f"the store at {self.root} is open in another process (a server, an ingest, an ask or the demo): "
            "`store rm --all` resets its settings, which that process keeps using; stop it first")
        try:
            files = [p for p, _ in self.docs.files()]
            chunks, kv = self.remove(files)
            disk = self.kv.tier("disk")
            kv += sum(disk.delete(k) for k in disk.entry_keys())
            _forget_settings(self.root)
        finally:
            self._open.shared()
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

    @contextlib.contextmanager
    def ingesting(self) -> Iterator[None]:
        """Held by an ingest from before it writes its first KV entry until its chunks are committed:
        its new entries are referenced by no chunk until then, and ``gc`` must not take them for
        garbage. Shared: ingests run side by side; ``gc`` takes it exclusively. Waits for a running gc."""
        self.check_writable("an ingest")
        with _held(self.root / "ingest.lock"):
            yield

    def gc(self, dry_run: bool = False, verify: bool = False, progress: bool = True) -> GcReport:
        """Remove what nothing needs from the store's disk KV tier, its Redis tier where it was opened
        with one (the store's own namespace there: ``_redis_namespace``), and its folder; return what went.

        - KV entries no stored chunk references: neither a chunk's stored key, nor the key ``ask``
          computes a chunk's KV under in any dtype (``forget_chunk_kv``), nor the instruction prefix's.
          That is KV of chunks removed while the model could not be found (``store rm``, ingest's
          removals), of a crash between an ingest's KV writes and its commit, of passages ``ask``
          was given rather than retrieved, of entries whose rows another process removed, of other
          settings left behind. Done holding ``ingest.lock`` exclusively, so no ingest is between
          writing KV and committing the chunks that reference it (an ingest running is a StoreError:
          run gc when it is done; an ingest starting waits for gc). An ``ask`` running meanwhile is
          no risk: what it stores is a referenced chunk's KV, or a passage's, which is garbage anyway.
        - Crash leftovers: the disk tier's (``DiskTier.remove_leftovers``: unlisted entry files, temp
          files of dead writers, listed entries whose file is gone) and temp files of ``write_atomic`` and
          index saves in the store folder. Temp files carry no owner the lock could tell about, so
          only dead ones go: the pid in a KV temp file's name runs no process, or a temp file was
          last written ``DEAD_TEMP_AGE_S`` ago (a live writer renames its temp file as soon as written).
        - With ``verify``: entries failing their checksum (read whole, which takes as long as reading
          the tiers), which ``ask`` would otherwise meet, drop and recompute.

        ``dry_run`` removes nothing and reports what would go. A store opened with ``sweep_kv=False``
        reports the disk tier's leftovers; another has swept them when it opened. A read-only store
        takes a dry run (with ``verify``, a check of a shipped store's entries), nothing more."""
        from ragfuse.engine.errors import ModelError
        from ragfuse.engine.kvstore.entry import DTYPES

        if not dry_run:
            self.check_writable("`ragfuse store gc` without --dry-run")
        try:
            fingerprint, builder = self._keying()
        except (ModelError, OSError) as exc:
            raise StoreError(f"cannot tell which KV entries the store's chunks use: model {self.config.model} is "
                             f"not found ({exc})") from exc
        disk: DiskTier = self.kv.tier("disk")  # type: ignore[assignment]
        report = GcReport(dry_run=dry_run, redis=TierGc() if self._has_tier("redis") else None)
        parts: list[tuple[_CollectableTier, TierGc]] = [(disk, report)]
        if report.redis is not None:
            parts.append((self.kv.tier("redis"), report.redis))  # type: ignore[arg-type]
        sizes = [tier.entry_sizes() for tier, _ in parts]
        if verify:
            for (tier, part), held in zip(parts, sizes):
                _drop_corrupt(tier, part, held, dry_run, progress)
        self._remove_leftovers(disk, report)
        busy = "an ingest is running on this store (another process): run gc once it is done"
        with _held(self.root / "ingest.lock", busy=busy):
            unused = [dict(held) for held in sizes]

            def in_use(key: str | None) -> None:
                for entries in unused:
                    entries.pop(key, None)  # type: ignore[arg-type]

            if builder is not None:
                for dtype in DTYPES.values():
                    in_use(kv_key(fingerprint, dtype, builder.prefix))
            for stored_key, token_ids in tqdm(self.docs.iter_kv_refs(), total=self.docs.counts()["chunks"],
                                              desc="finding unused KV", unit="chunk", disable=not progress):
                in_use(stored_key)
                for chunk_kv in self._chunk_kvs:
                    in_use(chunk_kv.key(token_ids))
            for (tier, part), entries in zip(parts, unused):
                for key, nbytes in entries.items():
                    if dry_run or tier.delete(key):
                        part.unreferenced_entries += 1
                        part.unreferenced_bytes += nbytes
        return report

    def _has_tier(self, name: str) -> bool:
        return any(t.name == name for t in self.kv.tiers)

    def _remove_leftovers(self, disk: DiskTier, report: GcReport) -> None:
        """The crash leftovers part of ``gc``: the disk tier's, then the store folder's temp files
        (``write_atomic``'s ``.NAME.*.tmp``; an index save's ``index.tmp``, dead outside the index lock)."""
        files, gone = disk.remove_leftovers(temp_max_age=DEAD_TEMP_AGE_S, dry_run=report.dry_run)
        report.leftover_files += [str(path.relative_to(self.root)) for path, _ in files]
        report.leftover_files += [f"KV entry {key} (listed, its file gone)" for key in gone]
        report.leftover_bytes += sum(nbytes for _, nbytes in files)
        profiles = self.root / "profiles"
        folders = [self.root, self.root / "uploads", profiles, *(p for p in profiles.rglob("*") if p.is_dir())]
        temps = [p for folder in folders for p in folder.glob(".*.tmp") if untouched_for(p) > DEAD_TEMP_AGE_S]
        with self._index_locked():
            for path in [*temps, self.index_path.with_suffix(".tmp")]:
                with contextlib.suppress(FileNotFoundError):
                    report.leftover_bytes += path.stat().st_size
                    report.leftover_files.append(str(path.relative_to(self.root)))
                    if not report.dry_run:
                        path.unlink()

    def close(self) -> None:
        self.docs.close()
        self.kv.close()
        self._open.release()


@contextlib.contextmanager
def _held(path: Path, busy: str | None = None) -> Iterator[None]:
    """The lock file ``path`` (the store's ``ingest.lock``, a read-only store's ``index.lock``) for the
    block (``FolderLock``): shared, waiting for an exclusive holder, or with ``busy`` exclusive, refused
    with that message (``FolderBusyError``) while another holds it. Released when the block ends or the
    process dies, so a crashed ingest never leaves a lock behind (a lock file's mere existence would)."""
    lock = FolderLock(path, exclusive=busy is not None, busy=busy or "", wait=busy is None)
    try:
        yield
    finally:
        lock.release()


def store_folder_writable(root: Path) -> bool:
    """Whether this process may write the store folder ``root`` (one not made yet: its parent's call)."""
    return not root.is_dir() or os.access(root, os.W_OK)


def check_store_folder_writable(root: Path, what: str) -> None:
    """Refuse ``what`` on a store folder this process cannot write (a read-only mount), before a model
    loads for it; ``RagStore.check_writable`` says the same once the store is open."""
    if not store_folder_writable(root):
        raise StoreError(_read_only(root, what))


def _read_only(root: Path, what: str) -> str:
    return (f"the store at {root} is read-only (a read-only mount, or a folder this user cannot write): {what} would "
            "change it. Search, ask and serve read it as it is; make changes where the store is writable")


def _forget_settings(root: Path) -> None:
    try:
        (root / "store.json").unlink(missing_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot remove {root / 'store.json'}: {exc.strerror}") from exc


def _drop_corrupt(tier: _CollectableTier, part: TierGc, sizes: dict[str, int], dry_run: bool,
                  progress: bool) -> None:
    """``gc --verify`` on one tier: read every entry of ``sizes`` whole; those failing their checksum
    are reported (and taken out of ``sizes``), and dropped unless ``dry_run``."""
    for key in tqdm(list(sizes), desc=f"verifying KV ({tier.name})", unit="entry", disable=not progress):
        ok = tier.intact(key)
        part.verified_entries += ok is not None
        if ok is False:
            part.corrupt_entries.append(key)
            part.corrupt_bytes += sizes.pop(key)
            if not dry_run:
                tier.drop(key)


def _redis_namespace(root: Path, lock: contextlib.AbstractContextManager[object]) -> str:
    """The store's own key prefix in a Redis server: ``ragfuse:kv:`` and an id the store records the
    first time it is opened with Redis. Entries are keyed by content, so on a server several stores
    share, one store's ``gc`` would take every other store's entries for unused; in its own namespace
    it sees only its own. An id, not the store's path: a store may be moved, or reached at other paths
    from other hosts sharing the server. The file also names its own inode: a copy of the store (a
    new file, the id copied) gets an id of its own, or its gc would remove the original's entries (a
    move to another filesystem looks like a copy: its entries are left to Redis's LRU). Under the
    store's index lock, so processes opening it at once record one id."""
    path = root / "redis_namespace"
    try:
        with lock:
            text = path.read_text().split() if path.exists() else []
            if len(text) == 2 and text[1] != str(path.stat().st_ino):  # a copy's file: not the one recorded
                path.unlink()
                text = []
            if not text:
                tmp = root / f".redis_namespace.{uuid.uuid4().hex}.tmp"
                with tmp.open("w") as f:
                    f.write(f"{uuid.uuid4().hex} {os.fstat(f.fileno()).st_ino}")
                try:
                    os.link(tmp, path)  # the same inode, under its final name
                finally:
                    tmp.unlink()
                text = path.read_text().split()
        namespace = text[0] if text else ""
    except OSError as exc:
        raise StoreError(f"cannot record the store's Redis namespace in {path}: {exc.strerror or exc}") from exc
    return _namespace_prefix(path, namespace)


def _recorded_redis_namespace(root: Path) -> str:
    """A read-only store's Redis prefix: the id its namespace file records, as it is (a read-only copy
    reads the original's entries, and adds only what is keyed by the same content)."""
    path = root / "redis_namespace"
    try:
        text = path.read_text().split()
    except FileNotFoundError:
        raise StoreError(f"the store at {root} is read-only and was never opened with Redis, so it has no Redis "
                         "namespace: open it once with --redis where it is writable, or run without --redis") from None
    except OSError as exc:
        raise StoreError(f"cannot read the store's Redis namespace in {path}: {exc.strerror or exc}") from exc
    return _namespace_prefix(path, text[0] if text else "")


def _namespace_prefix(path: Path, namespace: str) -> str:
    if not namespace.isalnum():
        raise StoreError(f"{path} does not hold a Redis namespace id ({namespace!r}): remove it, and the store's "
                         "entries in Redis are left to its LRU")
    return f"ragfuse:kv:{namespace}"
