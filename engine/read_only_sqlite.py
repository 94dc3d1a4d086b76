"""Reading a SQLite file that this process may not write (a store on a read-only mount).

A WAL-mode database opened ``mode=ro`` needs its ``-shm`` file, which exists only while a writer has
the database open: the last writer to close removes it, and a reader on a read-only mount cannot
make it. Without it, ``immutable`` is the only way in, and it reads the file as it is, with no locks
and no WAL, which is right only as long as nobody writes. A read-only bind of a store that is still
written (an ingest beside serving replicas) then read stale data, and after a checkpoint "database
disk image is malformed". So an immutable connection is kept only while the files stay as they were:
before each query the database file, its WAL and its ``-shm`` are looked at again (three ``stat``
calls), and the connection is opened anew where they changed (``mode=ro`` whenever a writer's ``-shm`` is
there); a query that still meets a changing file is retried once on a fresh connection. A store
nobody writes, the common case, never reopens. Nor does one opened ``mode=ro`` beside a writer: it
takes part in SQLite's WAL protocol (it reads the writer's ``-shm``, and its lock there keeps the last
writer from removing the WAL), so every query sees the last commit; reopening it whenever the files
changed made a reader of a store under constant writes reopen at every commit. A WAL left with
changes but without its ``-shm`` (a writer killed, the file lost) cannot be read without losing those
changes: that is an error, not older data served.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from .file_stamp import Stamp, file_stamp

_Stamps = tuple[Stamp | None, ...]


class Rows(list):
    """A query's rows, read whole, answering as a cursor does (``fetchone``, ``fetchall``, iteration)."""

    def fetchone(self) -> tuple | None:
        return self[0] if self else None

    def fetchall(self) -> list[tuple]:
        return list(self)


class ReadOnlyDatabase:
    """``execute(sql, args)`` returning every row (``Rows``), on a connection that never writes
    ``path`` nor its ``-wal``/``-shm``. ``probe``, run at each open, makes a file that cannot be read
    fail at once (``sqlite3.Error``) rather than at the first query."""

    def __init__(self, path: Path, probe: str = "SELECT COUNT(*) FROM sqlite_master") -> None:
        if not path.is_file():
            raise sqlite3.OperationalError(f"no such database: {path}")
        self.path, self._probe = path, probe
        self._lock = threading.Lock()  # the connectors read from worker threads
        self._db, self._stamp = self._open()

    def _open(self) -> tuple[sqlite3.Connection, _Stamps | None]:
        """A connection, and the files' stamps where it is a snapshot that must be reopened once they
        change (``immutable``); None where SQLite follows the writer itself (``mode=ro``)."""
        stamp = _stamps(self.path)
        uri = self.path.resolve().as_uri()
        try:
            return _probed(f"{uri}?mode=ro", self._probe), None
        except sqlite3.OperationalError:  # no -shm, and none can be made here
            wal = stamp[1]
            if wal is not None and wal[2] > 0:
                raise sqlite3.OperationalError(
                    f"{self.path} has changes in its write-ahead log that a read-only open cannot read (its -shm "
                    "file is missing): open the store once where it is writable") from None
            return _probed(f"{uri}?mode=ro&immutable=1", self._probe), stamp

    def execute(self, sql: str, args: Sequence[object] = ()) -> Rows:
        with self._lock:
            if self._stamp is not None and _stamps(self.path) != self._stamp:
                self._reopen()
            try:
                return Rows(self._db.execute(sql, args).fetchall())
            except sqlite3.DatabaseError:
                self._reopen()  # the file changed under the query: once more, on what it is now
                return Rows(self._db.execute(sql, args).fetchall())

    def _reopen(self) -> None:
        old = self._db
        self._db, self._stamp = self._open()
        old.close()

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _probed(uri: str, probe: str) -> sqlite3.Connection:
    db = sqlite3.connect(uri, uri=True, timeout=60, isolation_level=None, check_same_thread=False)
    try:
        db.execute(probe).fetchall()
    except BaseException:
        db.close()
        raise
    return db


def _stamps(path: Path) -> _Stamps:
    """What a writer changes: the database file, its WAL, its -shm."""
    return tuple(file_stamp(p) for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")))
