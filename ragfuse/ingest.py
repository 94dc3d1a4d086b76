"""Ingest: files -> documents -> token chunks -> embeddings + precomputed per-chunk KV -> store.

Order matters for "nothing stored is lost": embeddings and KV are computed first; only then is each
file's set of chunks swapped in one docstore transaction, and the index updated. An error before
that (disk full, bad file) leaves the store exactly as it was. Unchanged files (same content hash
and same settings, which the store enforces) keep their chunks as they are: for an ingest that
precomputes KV, the chunks whose KV is missing get it, keyed in place. KV no chunk uses any more is
deleted last, once every file's new chunks are in: a chunk that moved from one file to another keeps
its KV.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm.auto import tqdm

from ragfuse.chunk_kv import ChunkKV
from ragfuse.chunking import TokenChunker
from ragfuse.docstore import NewChunk
from ragfuse.documents import (
    DEFAULT_MAX_BYTES,
    FileNote,
    FoundFiles,
    LoadedFile,
    SkippedFile,
    find_files,
    load_file,
    utf8_name,
)
from ragfuse.embeddings import Embedder
from ragfuse.engine.kvstore import StoredKV
from ragfuse.prompt import RagPromptBuilder
from ragfuse.rag_store import RagStore

T = TypeVar("T")


class EngineRunner(Protocol):
    """Runs ``fn`` where the engine and the store may be used (and returns its result)."""

    def __call__(self, fn: Callable[[], T]) -> T: ...


def run_here(fn: Callable[[], T]) -> T:
    """The runner of a caller that owns the engine and store itself (the CLI, tests)."""
    return fn()


@dataclass
class IngestReport:
    new_files: list[str] = field(default_factory=list)
    replaced_files: list[str] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)  # gone from an ingested folder, or no root reaches it
    unchanged_files: list[str] = field(default_factory=list)
    # unchanged files whose chunks' KV was missing (a --no-kv ingest, KV evicted or dropped as damaged)
    # and computed now, their chunks kept as they were (ids, embeddings): listed among unchanged_files
    # too, as their text did not change, so the counts of changed files and chunks keep meaning changed text
    kv_filled_files: list[str] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    notes: list[FileNote] = field(default_factory=list)  # files read, but in part or through the fallback encoding
    chunks_added: int = 0
    chunks_removed: int = 0
    kv_computed: int = 0
    kv_reused: int = 0
    kv_removed: int = 0
    # stored KV the disk tier evicted to stay within its capacity (``--kv-capacity-gb``), any chunk's
    # or ``ask``'s: the store's other files then recompute theirs when asked
    kv_evicted: int = 0
    tokens: int = 0  # of the new and changed files' chunks
    seconds: float = 0.0
    kv_seconds: float = 0.0


@dataclass
class _Pending:
    file: LoadedFile
    sources: list[str]
    texts: list[str]
    token_ids: list[tuple[int, ...]]


@dataclass
class _KVFill:
    """An unchanged file whose stored chunks lack their KV (or its key): by chunk id, the tokens."""

    path: str
    chunks: dict[int, tuple[int, ...]]


class Ingestor:
    def __init__(self, store: RagStore, engine: Any, embedder: Embedder, precompute_kv: bool = True,
                 kv_batch_tokens: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES, text_field: str = "text",
                 title_field: str | None = "title", progress: bool = True, on_engine: EngineRunner = run_here,
                 tokenizer: Any = None, encoding: str | None = None) -> None:
        """``on_engine``: how to run a step that uses the engine or the store; ``tokenizer``: the
        chunker's (default the engine's; a caller chunking on another thread passes its own copy,
        since a fast tokenizer's settings are shared state); ``encoding``: how to read text files
        that are not UTF-8 (None: skip them)."""
        self.store, self.engine, self.embedder = store, engine, embedder
        self.on_engine = on_engine
        self.chunker = TokenChunker(tokenizer if tokenizer is not None else engine.tokenizer,
                                    store.config.chunk_tokens, store.config.chunk_overlap)
        # how the store's chunks get their KV (after the instruction prefix, or alone): the
        # pipeline keys and computes them the same way, from the same store setting
        self.chunk_kv = ChunkKV.for_context(engine, store.config.chunk_kv_context) if precompute_kv else None
        # every RAG prompt starts with the instruction prefix, whose KV the pipeline keys alone (it is an
        # exact prefix): stored with the chunks, so the first question after an ingest computes none
        self.prefix = RagPromptBuilder(engine.tokenizer).prefix if precompute_kv else None
        self.kv_batch_tokens = kv_batch_tokens
        self.max_bytes, self.text_field, self.title_field = max_bytes, text_field, title_field
        self.encoding = encoding
        self.progress = progress

    def ingest(self, paths: Iterable[str | Path]) -> IngestReport:
        """Add, replace or keep each file found under ``paths``. A folder is mirrored: its files
        stored before and deleted since are removed, so a deleted document stops being retrieved,
        and so are files it no longer reaches (a linked folder removed or re-pointed) unless another
        ingest root still holds them (a folder or file ingested on its own). A file named alone, one
        that is now skipped, or one stored before roots were recorded is never removed for being
        out of reach: ``store rm`` does that. A path that does not exist changes nothing stored."""
        self.store.check_writable("an ingest")  # before any file is read or embedded
        t0 = time.perf_counter()
        report = IngestReport()
        evictions = self.store.kv.tier("disk").stats().evictions
        paths = [Path(p) for p in paths]
        found = find_files(paths, exclude=self.store.root)
        report.skipped = found.missing
        # a root whose walk could not list every folder neither removes nor records what it missed
        roots = _storable_roots({root: files for root, files in found.roots.items() if root not in found.incomplete})
        report.removed_files = self.on_engine(lambda: self._gone_files(found, roots))
        pending: list[_Pending] = []
        fills: list[_KVFill] = []
        for path in tqdm(found.files, desc="reading", unit="file", disable=not self.progress):
            loaded = load_file(path, self.max_bytes, self.text_field, self.title_field, self.encoding)
            if isinstance(loaded, SkippedFile):
                report.skipped.append(loaded)
                continue
            report.notes += [FileNote(loaded.path, note) for note in loaded.notes]
            fill = self.on_engine(lambda loaded=loaded: self._kv_fill(loaded))
            if fill is None:
                pending.append(self._chunk(loaded))
                continue
            report.unchanged_files.append(loaded.path)
            if fill.chunks:
                fills.append(fill)
        texts = [t for p in pending for t in p.texts]
        vectors = self.embedder.encode(texts, progress=self.progress and bool(texts))
        chunk_kv = self.chunk_kv
        with self.store.ingesting():  # its new KV is no chunk's until the commit: `store gc` must keep it
            if chunk_kv is not None:
                t1 = time.perf_counter()
                self._precompute(chunk_kv, [ids for p in pending for ids in p.token_ids]
                                 + [ids for f in fills for ids in f.chunks.values()], report)
                report.kv_seconds = time.perf_counter() - t1
            old_refs = self.on_engine(lambda: self._commit(pending, fills, vectors, report, roots))
        # only now, with every file's new chunks in, can "no chunk uses it" be told: a key one file
        # dropped may be a chunk that moved to another file of this ingest. Replaced chunks lose
        # their stored KV and also what `ask` stored for them (as `store rm` does); after this
        # ingest's hold on the store, since the forgetting waits for no other ingest to run
        report.kv_removed = self.on_engine(lambda: self.store.forget_chunk_kv(old_refs))
        report.kv_evicted = self.store.kv.tier("disk").stats().evictions - evictions
        report.seconds = time.perf_counter() - t0
        return report

    def _gone_files(self, found: FoundFiles, roots: dict[str, list[str]]) -> list[str]:
        """Stored files below the real folders a folder ingest walked (a linked folder's target among
        them: its files are stored by their resolved paths) that no longer exist, then those the walk
        of every root recorded for them no longer reached (a root not walked now, or the unknown
        root of a file stored before roots were recorded, keeps a file)."""
        walked = {str(f) for f in found.folders}
        if not walked:  # files named alone (a server upload), each its own root and found under it:
            return []   # no scan of the stored list on the engine thread
        deleted = [f for f, _ in self.store.docs.files()
                   if any(str(parent) in walked for parent in Path(f).parents) and not os.path.lexists(f)]
        walked_roots = set(roots)
        reached = {str(f) for f in found.files}
        unreached = [f for f, had in self.store.docs.file_roots(walked_roots).items()
                     if f not in reached and had <= walked_roots]
        return list(dict.fromkeys(deleted + sorted(unreached)))

    def _commit(self, pending: list[_Pending], fills: list[_KVFill], vectors: Any, report: IngestReport,
                roots: dict[str, list[str]]) -> list[tuple[str | None, tuple[int, ...]]]:
        """Swap each changed file's chunks in, key the KV-filled files' chunks in place, record what
        each root reached, update the index once; return the replaced chunks' KV references, whose
        KV goes where no chunk uses it any more."""
        chunk_kv = self.chunk_kv
        offset = 0
        all_removed: list[int] = []
        all_added: list[int] = []
        old_refs = self.store.docs.kv_refs(report.removed_files)
        all_removed += self.store.docs.remove_files(report.removed_files)
        report.chunks_removed += len(all_removed)
        for p in pending:
            n = len(p.texts)
            chunks = [
                NewChunk(src, text, ids, chunk_kv.key(ids) if chunk_kv is not None else None, vec)
                for src, text, ids, vec in zip(p.sources, p.texts, p.token_ids, vectors[offset:offset + n])
            ]
            old_refs += self.store.docs.kv_refs([p.file.path])
            stored_hash = self.store.docs.file_hash(p.file.path)
            removed, added = self.store.docs.replace_file(p.file.path, p.file.content_hash, chunks)
            all_removed += removed
            all_added += added
            offset += n
            (report.replaced_files if stored_hash is not None else report.new_files).append(p.file.path)
            report.chunks_added += len(added)
            report.chunks_removed += len(removed)
            report.tokens += sum(len(ids) for ids in p.token_ids)
        if fills:
            assert chunk_kv is not None
            old_refs += self.store.docs.kv_refs([f.path for f in fills])
            self.store.docs.set_kv_keys({i: chunk_kv.key(ids) for f in fills for i, ids in f.chunks.items()})
            report.kv_filled_files += [f.path for f in fills]
        self.store.docs.record_roots(roots)
        if pending or all_removed:  # one index update (and save) for the whole ingest; until then the saved
            # index is behind the docstore's generation and a crash would make the next open rebuild it
            self.store.apply_changes(all_removed, all_added, vectors)
        return old_refs

    def _kv_fill(self, loaded: LoadedFile) -> _KVFill | None:
        """None where ``loaded`` is new or its text changed (it is chunked again); else its stored
        chunks that lack their KV, when this ingest precomputes KV (none: the file is unchanged). A
        file ingested with --no-kv, or whose KV was evicted or dropped, keeps its chunks as they are
        (the store's settings fix the chunking): their ids stay what clients saw, and they are not
        embedded again."""
        if self.store.docs.file_hash(loaded.path) != loaded.content_hash:
            return None
        chunk_kv = self.chunk_kv
        if chunk_kv is None:
            return _KVFill(loaded.path, {})
        chunks = self.store.docs.chunks(self.store.docs.chunk_ids(loaded.path)).values()
        kv = self.store.kv
        return _KVFill(loaded.path, {c.id: c.token_ids for c in chunks
                                     if c.kv_key != chunk_kv.key(c.token_ids) or kv.locate(c.kv_key) is None})

    def _chunk(self, loaded: LoadedFile) -> _Pending:
        p = _Pending(loaded, [], [], [])
        for doc in loaded.documents:
            for chunk in self.chunker.split(doc.text):
                p.sources.append(doc.source)
                p.texts.append(chunk.text)
                p.token_ids.append(chunk.token_ids)
        return p

    def _precompute(self, chunk_kv: ChunkKV, token_lists: list[tuple[int, ...]], report: IngestReport) -> None:
        """Compute the KV of every chunk not stored yet, in batches of at most ``kv_batch_tokens`` (a
        longer chunk alone): each batch is one call on the engine, which a server's running streams
        wait for, so a batch never grows past the bound to take one more chunk."""
        keyed = {chunk_kv.key(ids): ids for ids in token_lists}
        stored = self.on_engine(lambda: {k for k in keyed if self.store.kv.persist(k)})
        report.kv_reused += len(stored)
        todo = {k: ids for k, ids in keyed.items() if k not in stored}
        prefix = self.prefix
        if prefix:  # not counted among the chunks' KV
            self.on_engine(lambda: self._store_prefix_kv(prefix))
        with tqdm(total=sum(map(len, todo.values())), desc="precomputing KV", unit="tok",
                  disable=not self.progress or not todo) as bar:
            for batch in token_batches(list(todo.items()), self.kv_batch_tokens):
                self.on_engine(lambda batch=batch: self._store_kv(chunk_kv, batch))
                report.kv_computed += len(batch)
                bar.update(sum(len(ids) for _, ids in batch))

    def _store_prefix_kv(self, prefix: list[int]) -> None:
        """The instruction prefix's KV, computed alone, where it is not stored yet."""
        alone = ChunkKV(self.engine)
        key = alone.key(prefix)
        if self.store.kv.locate(key) is None:
            (k, v), = alone.compute([prefix])
            self.store.kv.put(StoredKV.from_kv(key, k, v))

    def _store_kv(self, chunk_kv: ChunkKV, batch: list[tuple[str, tuple[int, ...]]]) -> None:
        for (key, _), (k, v) in zip(batch, chunk_kv.compute([list(ids) for _, ids in batch])):
            self.store.kv.put(StoredKV.from_kv(key, k, v))


def _storable_roots(roots: dict[Path, list[Path]]) -> dict[str, list[str]]:
    """``FoundFiles.roots`` as the docstore records them, less names that are not UTF-8: SQLite
    cannot hold them, and no such file is ever stored (``load_file`` skips it), so none has a root."""
    return {str(root): [str(f) for f in files if utf8_name(f)] for root, files in roots.items() if utf8_name(root)}


def token_batches(items: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``(key, token ids)`` items in order, cut into runs of at most ``limit`` tokens (a longer item alone)."""
    batches: list[list[tuple[str, tuple[int, ...]]]] = []
    size = 0
    for item in items:
        if not batches or size + len(item[1]) > limit:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += len(item[1])
    return batches
