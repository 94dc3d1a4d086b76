"""The SQLite docstore: ingested files (with content hashes), their chunks, and chunk embeddings.

It is the source of truth of a store: the faiss index is rebuilt from it, and a file's chunks are
replaced in one transaction, so a crash leaves either the old chunks or the new ones.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
    def __init__(self, path: Path) -> None:
        # framework connectors read it from worker threads (a batch, an async stream); SQLite is built
        # serialized (sqlite3.threadsafety 3), and writes (ingest) come from one thread at a time
        self.db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
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
            CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
            """
        )

    @property
    def generation(self) -> int:
        """Bumped by every change; the index records which generation it reflects."""
        row = self.db.execute("SELECT v FROM meta WHERE k='generation'").fetchone()
        return int(row[0]) if row else 0

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
                    (path, c.source, i, c.text, np.asarray(c.token_ids, dtype=np.int32).tobytes(), c.kv_key,
                     np.asarray(c.embedding, dtype=np.float32).tobytes()),
                )
                new_ids.append(int(cur.lastrowid))
            self.db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                            (path, content_hash, len(chunks), time.time()))
        return removed, new_ids

    def remove_files(self, paths: Sequence[str]) -> list[int]:
        with self._tx():
            return [i for p in paths for i in self._remove(p)]

    def chunk_ids(self, path: str) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE file=?", (path,))]

    def _remove(self, path: str) -> list[int]:
        ids = [r[0] for r in self.db.execute("SELECT id FROM chunks WHERE file=?", (path,))]
        self.db.execute("DELETE FROM chunks WHERE file=?", (path,))
        self.db.execute("DELETE FROM files WHERE path=?", (path,))
        return ids

    def _tx(self) -> _Transaction:
        return _Transaction(self.db)

    def files(self, prefix: str | None = None) -> list[tuple[str, int]]:
        """(path, chunk count) of stored files, under ``prefix`` when given."""
        rows = self.db.execute("SELECT path, num_chunks FROM files ORDER BY path").fetchall()
        if prefix is None:
            return rows
        return [r for r in rows if r[0] == prefix or r[0].startswith(prefix.rstrip("/") + "/")]

    def chunks(self, ids: Sequence[int]) -> dict[int, StoredChunk]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self.db.execute(
            f"SELECT id, file, source, ord, text, token_ids, kv_key FROM chunks WHERE id IN ({marks})", list(ids)
        ).fetchall()
        return {r[0]: StoredChunk(r[0], r[1], r[2], r[3], r[4], tuple(np.frombuffer(r[5], dtype=np.int32).tolist()),
                                  r[6]) for r in rows}

    def all_embeddings(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.db.execute("SELECT id, embedding FROM chunks ORDER BY id").fetchall()
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), dim)
        return ids, vecs

    def kv_keys_in_use(self, keys: Sequence[str]) -> set[str]:
        if not keys:
            return set()
        marks = ",".join("?" * len(keys))
        return {r[0] for r in self.db.execute(f"SELECT DISTINCT kv_key FROM chunks WHERE kv_key IN ({marks})",
                                              list(keys))}

    def counts(self) -> dict[str, int]:
        files = self.db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
        chunks, tokens = self.db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(token_ids)) / 4, 0) FROM chunks"
                                         ).fetchone()
        return {"files": files, "chunks": chunks, "tokens": tokens}

    def close(self) -> None:
        self.db.close()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, with the generation bumped inside, so the index can tell."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.db.execute("ROLLBACK")
            return
        self.db.execute("INSERT INTO meta VALUES ('generation', '1') ON CONFLICT(k) DO UPDATE SET v = v + 1")
        self.db.execute("COMMIT")
