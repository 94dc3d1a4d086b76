"""Opening a SQLite file that this process may not write (a store on a read-only mount).

A WAL-mode database opened with ``mode=ro`` still needs its ``-shm`` file, which SQLite cannot
create on a read-only filesystem once the last writer closed cleanly and removed it. ``immutable``
then reads the file as it is, without locks: right for a mount nobody writes behind (a store shipped
in an image); where a writer does exist behind the mount (a read-only bind of a live store), its
``-shm`` is there and ``mode=ro`` reads its commits as a reader should.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect_read_only(path: Path, probe: str = "SELECT COUNT(*) FROM sqlite_master") -> sqlite3.Connection:
    """A connection that never writes ``path`` (nor its ``-wal``/``-shm``). ``probe``, run once, makes a
    file that cannot be read this way fail here rather than at the first query."""
    if not path.is_file():
        raise sqlite3.OperationalError(f"no such database: {path}")
    uri = path.resolve().as_uri()
    try:
        return _probed(f"{uri}?mode=ro", probe)
    except sqlite3.OperationalError:  # no -shm beside a WAL file, and none can be made
        return _probed(f"{uri}?mode=ro&immutable=1", probe)


def _probed(uri: str, probe: str) -> sqlite3.Connection:
    db = sqlite3.connect(uri, uri=True, timeout=60, isolation_level=None, check_same_thread=False)
    try:
        db.execute(probe).fetchall()
    except BaseException:
        db.close()
        raise
    return db
