"""The SQLite docstore: ingested files (with content hashes), their chunks, chunk embeddings, and
the ingest roots (paths given to ``ragfuse ingest``) under which each file was found.

It is the source of truth of a store: the faiss index is rebuilt from it, and a file's chunks are
replaced in one transaction, so a crash leaves either the old chunks or the new ones.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ragfuse.engine.read_only_sqlite import ReadOnlyDatabase
from ragfuse.store_dir import StoreError

T = TypeVar("T")
# bound values per statement: SQLite's smallest default limit (builds differ, from 999 to 250,000), so
# an IN list of any length is sent in pieces every build accepts
SQL_VARIABLES = 999
KV_REFS_PAGE = 4096  # chunks a read-only docstore reads at once for ``iter_kv_refs``
# the root of the files stored before roots were recorded: which paths reached them is not known, so
# they keep this root, which no ingest walks, and are never removed for a root no longer reaching them
UNKNOWN_ROOT = ""


def batches(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """``items`` in pieces of at most ``SQL_VARIABLES``, one statement's worth of bound values each."""
    for i in range(0, len(items), SQL_VARIABLES):
        yield items[i:i + SQL_VARIABLES]


@dataclass(frozen=True)
class StoredChunk:
    id: int
    file: str
    source: str
    ord: int
    text: str
    token_ids: tuple[int, ...]
    kv_key: str | None


@dataclass(frozen=True)
class NewChunk:
    source: str
    text: str
    token_ids: tuple[int, ...]
    kv_key: str | None
    embedding: np.ndarray


class DocStore:
    def __init__(self, path: Path, read_only: bool = False) -> None:
        """``read_only``: a store on a read-only mount, whose docstore is read as it is (nothing created
        or upgraded; ``connect_read_only``)."""
        self.path = path
        # generations this docstore's own transactions committed: an index that saw all changes up to
        # one generation plus these is current without a rebuild (``changed_only_here``)
        self.own_generations: set[int] = set()
        self.read_only = read_only
        try:
            if read_only:  # queried as a connection is (``execute``); never written
                self.db = ReadOnlyDatabase(path, "SELECT v FROM meta LIMIT 1")  # type: ignore[assignment]
                return
            # framework connectors read it from worker threads (a batch, an async stream); SQLite is built
            # serialized (sqlite3.threadsafety 3), and writes (ingest) come from one thread at a time
            self.db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the docstore {path}: {exc}") from exc
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.executescript(
                """
                CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, content_hash TEXT NOT NULL,
                    num_chunks INTEGER NOT NULL, ingested REAL NOT NULL);
                CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY AUTOINCREMENT, file TEXT NOT NULL,
                    source TEXT NOT NULL, ord INTEGER NOT NULL, text TEXT NOT NULL, token_ids BLOB NOT NULL,
                    kv_key TEXT, embedding BLOB NOT NULL);
                CREATE INDEX IF NOT EXISTS chunks_file ON chunks(file);
                CREATE INDEX IF NOT EXISTS chunks_kv ON chunks(kv_key);
                CREATE INDEX IF NOT EXISTS chunks_head ON chunks(substr(token_ids, 1, 64));
                CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
                """
            )
            self._add_file_roots()
            self.generation  # noqa: B018 - a first read, so a damaged file fails here, named
        except sqlite3.Error as exc:
            self.db.close()
            raise StoreError(f"cannot open the docstore {path}: {exc}") from exc

    def _add_file_roots(self) -> None:
        """Create the table of the roots each file was found under; in a store made before it (its
        files stored, but not which roots reached them), each file gets ``UNKNOWN_ROOT``, so it is
        kept as before: removed by a re-ingest only once deleted from a folder walked (or by
        ``store rm``), never because a linked folder no longer reaches it. Checked again inside the
        transaction: another process may have added the table and recorded roots since."""
        if self._has_file_roots():
            return
        with self._tx(bump=False):
            if self._has_file_roots():
                return
            self.db.execute("CREATE TABLE file_roots (file TEXT NOT NULL, root TEXT NOT NULL,"
                            " PRIMARY KEY (file, root))")
            self.db.execute("CREATE INDEX file_roots_root ON file_roots(root)")
            self.db.execute("INSERT INTO file_roots SELECT path, ? FROM files", (UNKNOWN_ROOT,))

    def _has_file_roots(self) -> bool:
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='file_roots'"
                               ).fetchone() is not None

    @property
    def generation(self) -> int:
        """Bumped by every change; the index records which generation it reflects."""
        row = self.db.execute("SELECT v FROM meta WHERE k='generation'").fetchone()
        return int(row[0]) if row else 0

    def changed_only_here(self, since: int, until: int) -> bool:
        """Whether every change after generation ``since`` up to ``until`` was committed through this
        docstore (another process's commit in between makes an index kept since ``since`` stale)."""
        return all(g in self.own_generations for g in range(since + 1, until + 1))

    def file_hash(self, path: str) -> str | None:
        row = self.db.execute("SELECT content_hash FROM files WHERE path=?", (path,)).fetchone()
        return row[0] if row else None

    def replace_file(self, path: str, content_hash: str, chunks: Sequence[NewChunk]) -> tuple[list[int], list[int]]:
        """Swap ``path``'s chunks for ``chunks`` atomically; return (removed ids, new ids)."""
        with self._tx():
            removed = self._remove(path)
            new_ids = []
            for i, c in enumerate(chunks):
                cur = self.db.execute(
                    "INSERT INTO chunks (file, source, ord, text, token_ids, kv_key, embedding)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (path, c.source, i, c.text, _blob(c.token_ids), c.kv_key,
                     np.asarray(c.embedding, dtype=np.float32).tobytes()),
                )
                new_ids.append(int(cur.lastrowid))
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                            (path, content_hash, len(chunks), time.time()))
        return removed, new_ids

    def set_kv_keys(self, keys: Mapping[int, str]) -> None:
        """Key chunks' KV (chunk id -> key) in place: the chunks, so the index, stay as they are."""
        with self._tx(bump=False):
            self.db.executemany("UPDATE chunks SET kv_key=? WHERE id=?", [(k, i) for i, k in keys.items()])

    def remove_files(self, paths: Sequence[str]) -> list[int]:
        """Remove ``paths`` with their chunks; return the chunk ids removed. None to remove commits
        nothing: a generation bumped with no chunk changed would leave the saved index stale, to be
        rebuilt by the next open (an ingest that finds every file unchanged did that)."""
        if not paths:
            return []
        with self._tx():
            return [i for p in paths for i in self._remove(p)]

    def chunk_ids(self, path: str) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE file=?", (path,))]

    def _remove(self, path: str) -> list[int]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE file=?", (path,))]
        self.db.execute("DELETE FROM chunks WHERE file=?", (path,))
        self.db.execute("DELETE FROM files WHERE path=?", (path,))
        self.db.execute("DELETE FROM file_roots WHERE file=?", (path,))
        return ids

    def record_roots(self, found: Mapping[str, Collection[str]]) -> None:
        """Record that the walk of each root found exactly the files ``found[root]``: the stored ones
        among them get the root, and stored files it no longer finds lose it. Chunks are untouched, so
        the generation (which the index follows) stays."""
        with self._tx(bump=False):
            for root, files in found.items():
                had = {r[0] for r in self.db.execute("SELECT file FROM file_roots WHERE root=?", (root,))}
                now = set(files)
                self.db.executemany("DELETE FROM file_roots WHERE file=? AND root=?", [(f, root) for f in had - now])
                self.db.executemany("INSERT INTO file_roots SELECT path, ? FROM files WHERE path=?",
                                    [(root, f) for f in now - had])

    def file_roots(self, roots: Collection[str]) -> dict[str, set[str]]:
        """Every recorded root of each stored file recorded under one of ``roots`` (a file stored before
        roots were recorded has ``UNKNOWN_ROOT`` among them; one with no root row at all, which a crash
        between its commit and ``record_roots`` leaves, is not listed, so an ingest keeps it)."""
        found: dict[str, set[str]] = {}
        for part in batches(list(roots)):
            for file, root in self.db.execute(
                    "SELECT file, root FROM file_roots WHERE file IN"
                    f" (SELECT file FROM file_roots WHERE root IN ({_marks(part)}))", part):
                found.setdefault(file, set()).add(root)
        return found

    def folder(self, name: str) -> str | None:
        """Where the files the store keeps in its own folder ``name`` were last recorded (``move_folder``)."""
        row = self.db.execute("SELECT v FROM meta WHERE k=?", (f"folder:{name}",)).fetchone()
        return row[0] if row else None

    def move_folder(self, name: str, to: str) -> None:
        """Record the store's own folder ``name`` (its uploads) as at ``to``, the paths of the files
        recorded under its previous place moved with it. Files are keyed by absolute path, so a store
        moved to another folder found the files it keeps inside itself under a path that no longer
        exists. Chunk ids and embeddings stay, so the index stays current (no generation bump). A file
        recorded at both places must be removed from one first."""
        if self.folder(name) == to:  # as recorded: no write lock taken
            return
        key = f"folder:{name}"
        with self._tx(bump=False):
            row = self.db.execute("SELECT v FROM meta WHERE k=?", (key,)).fetchone()
            if row is not None and row[0] != to:
                old, new = row[0].rstrip("/") + "/", to.rstrip("/") + "/"
                for table, column in (("files", "path"), ("chunks", "file"), ("chunks", "source"),
                                      ("file_roots", "file"), ("file_roots", "root")):
                    self.db.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE"
                                    f" substr({column}, 1, ?) = ?", (new, len(old) + 1, len(old), old))
            self.db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, to))

    def _tx(self, bump: bool = True) -> _Transaction:
        """A write transaction; ``bump``: it changes chunks, so the generation moves on."""
        return _Transaction(self, bump)

    def files(self, prefix: str | None = None) -> list[tuple[str, int]]:
        """(path, chunk count) of stored files, under ``prefix`` when given."""
        rows = self.db.execute("SELECT path, num_chunks FROM files ORDER BY path").fetchall()
        if prefix is None:
            return rows
        return [r for r in rows if r[0] == prefix or r[0].startswith(prefix.rstrip("/") + "/")]

    def chunks(self, ids: Sequence[int]) -> dict[int, StoredChunk]:
        rows = [r for part in batches(list(ids)) for r in self.db.execute(
            f"SELECT id, file, source, ord, text, token_ids, kv_key FROM chunks WHERE id IN ({_marks(part)})", part)]
        return {r[0]: StoredChunk(r[0], r[1], r[2], r[3], r[4], _tokens(r[5]), r[6]) for r in rows}

    def kv_refs(self, paths: Sequence[str]) -> list[tuple[str | None, tuple[int, ...]]]:
        """(stored KV key, token ids) of every chunk of ``paths``: what their KV can be found by."""
        return [(r[0], _tokens(r[1])) for p in paths
                for r in self.db.execute("SELECT kv_key, token_ids FROM chunks WHERE file=?", (p,))]

    def iter_kv_refs(self) -> Iterator[tuple[str | None, tuple[int, ...]]]:
        """(stored KV key, token ids) of every chunk, read one at a time (a store's chunks may not fit
        in memory at once), from one snapshot of the docstore; read-only, in pages of ids, since
        such a connection answers each query whole (``ReadOnlyDatabase``; a writer behind the mount
        may commit between two pages)."""
        if not self.read_only:
            for kv_key, token_ids in self.db.cursor().execute("SELECT kv_key, token_ids FROM chunks"):
                yield kv_key, _tokens(token_ids)
            return
        after = -1
        while rows := self.db.execute("SELECT id, kv_key, token_ids FROM chunks WHERE id > ? ORDER BY id LIMIT ?",
                                      (after, KV_REFS_PAGE)):
            for _, kv_key, token_ids in rows:
                yield kv_key, _tokens(token_ids)
            after = rows[-1][0]

    def chunk_heads(self, n: int) -> list[tuple[int, str]]:
        """(id, first ``n`` characters) of every chunk at least ``n`` characters long."""
        return self.db.execute("SELECT id, substr(text, 1, ?) FROM chunks WHERE length(text) >= ?", (n, n)).fetchall()

    def all_embeddings(self, dim: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(generation, ids, embeddings) of every chunk, read in one transaction, so the generation is
        the one the embeddings are at even while another process commits."""
        try:
            self.db.execute("BEGIN")
            try:
                generation = self.generation
                rows = self.db.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
            finally:
                self.db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot read the embeddings in the docstore {self.path}: {exc}") from exc
        blob = b"".join(r[1] for r in rows)
        if len(blob) != len(rows) * dim * 4:
            raise StoreError(f"the docstore {self.path} holds embeddings of another size than {dim} dimensions "
                             "(the store's embedding_dim)")
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        return generation, ids, np.frombuffer(blob, dtype=np.float32).reshape(len(rows), dim)

    def kv_keys_in_use(self, keys: Collection[str]) -> set[str]:
        """Which of ``keys`` some chunk still has as its stored KV key."""
        return {r[0] for part in batches(list(keys)) for r in self.db.execute(
            f"SELECT DISTINCT kv_key FROM chunks WHERE kv_key IN ({_marks(part)})", part)}

    def token_ids_in_use(self, token_lists: Collection[tuple[int, ...]]) -> set[tuple[int, ...]]:
        """Which of ``token_lists`` some chunk still has (its KV, wherever stored, is still wanted).

        Found through the index over the first 16 tokens (``chunks_head``), then compared whole."""
        blobs = {_blob(t): t for t in token_lists}
        heads = list({b[:64] for b in blobs})
        return {blobs[r[0]] for part in batches(heads) for r in self.db.execute(
            f"SELECT DISTINCT token_ids FROM chunks WHERE substr(token_ids, 1, 64) IN ({_marks(part)})", part)
            if r[0] in blobs}

    def counts(self) -> dict[str, int]:
        files = self.db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
        chunks, tokens = self.db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(token_ids)) / 4, 0) FROM chunks"
                                         ).fetchone()
        return {"files": files, "chunks": chunks, "tokens": tokens}

    def close(self) -> None:
        self.db.close()


def _blob(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int32).tobytes()


def _tokens(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype=np.int32).tolist())


def _marks(values: Sequence[object]) -> str:
    return ",".join("?" * len(values))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, with the generation bumped inside (unless ``bump`` is false: no
    chunk changed, and an index saved at the generation must stay current), so the index can tell;
    the generation committed is recorded as the docstore's own."""

    def __init__(self, docs: DocStore, bump: bool) -> None:
        self.docs, self.db, self.bump = docs, docs.db, bump

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.db.execute("ROLLBACK")
            return
        if not self.bump:
            self.db.execute("COMMIT")
            return
        self.db.execute("INSERT INTO meta VALUES ('generation', '1') ON CONFLICT(k) DO UPDATE SET v = v + 1")
        generation = self.docs.generation
        self.db.execute("COMMIT")
        self.docs.own_generations.add(generation)
