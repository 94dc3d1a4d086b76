"""The local-disk tier: one safetensors file per entry, a SQLite manifest, crash- and share-safe.

Safety rules, each for a fault the tests inject:
- a file is written under a temporary name, fsynced, then renamed into place, and only then listed
  in the manifest: a process killed mid-write leaves a temp file (removed by the next opener) or an
  unlisted file (also removed), never a listed half-written entry;
- every layer is checked against its checksum as it is read; a mismatch drops the entry and reports
  a miss, so the caller recomputes instead of attending over garbage;
- manifest changes, renames and evictions happen under one file lock, so processes sharing the
  directory never evict each other's half-registered entries or double-count bytes;
- a write that hits a full disk (ENOSPC, quota, file-size limit) deletes its temp file and raises
  ``DiskFullError``; nothing listed is touched;
- the manifest is only an index of the entry files, each of which holds its key and checksums: a
  manifest SQLite cannot read is moved aside (``manifest.sqlite.corrupt-*``) and a new one lists the
  files whose headers read, instead of the tier failing to open (or its sweep deleting every file).

Files are valid safetensors (tensor ``layer.0000`` ... holding ``[2, tokens, heads, dim]``, metadata
``ragfuse_kv``). The reader parses the header itself and ``readinto``s each layer straight into its
destination buffer (page-locked when the data goes to a GPU): one copy, and layer by layer. Reads
into CPU memory land in buffers of a ``HostBufferPool`` (see there: fresh memory costs a page fault
per 4 KiB inside the read, reused memory does not).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import sqlite3
import struct
import threading
import time
import uuid
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import save as safetensors_save

from ..read_only_sqlite import ReadOnlyDatabase
from .buffer_pool import HostBufferPool, shared_pool
from .entry import CorruptEntryError, EntryMeta, KVStoreError, StoredKV, UnreadableEntryError, tensor_bytes
from .tier import Tier, TierStats

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# bytes from a layer about to be read that the kernel is asked to read ahead (``DiskEntryReader.read_ahead``).
# Read layer by layer with only the kernel's own readahead, a fused pass from the disk tier waited 1-31 ms
# every fourth layer or so (H200 hosts, page cache dropped; results/fusion-h200-1201c)
READ_AHEAD_BYTES = 16 << 20
META_FIELD = "ragfuse_kv"
log = logging.getLogger("ragfuse.kvstore")


class DiskFullError(KVStoreError):
    """The disk (or quota, or file-size limit) has no room for an entry; the store is unchanged."""


def layer_name(i: int) -> str:
    return f"layer.{i:04d}"


def drop_page_cache(path: str | Path) -> None:
    """Ask the kernel to forget its cached pages of ``path``, so the next read really hits the disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DiskEntryReader:
    """Reads one entry's layers one at a time, each verified before it is returned.

    For the fusor: it can ask for layer ``i + 1`` while layer ``i`` computes.
    """

    def __init__(self, path: Path, expected_checksum: str | None) -> None:
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()/__exit__
        try:
            (n,) = struct.unpack("<Q", self._read_exact(8))
            if n > 64 << 20:
                raise CorruptEntryError(f"{path.name}: header of {n} bytes")
            header = json.loads(self._read_exact(n))
            self.meta = EntryMeta.from_json(json.loads(header["__metadata__"][META_FIELD]))
            self._offsets = [header[layer_name(i)]["data_offsets"] for i in range(self.meta.num_layers)]
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            self._f.close()
            raise CorruptEntryError(f"{path.name}: unreadable header ({exc})") from exc
        except BaseException:
            self._f.close()
            raise
        self._base = 8 + n
        self._end = self._base + max((end for _, end in self._offsets), default=0)  # of the layers' bytes
        if expected_checksum is not None and self.meta.checksum != expected_checksum:
            self._f.close()
            raise CorruptEntryError(f"{path.name}: checksum differs from the manifest's")

    def _read_exact(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise CorruptEntryError("entry file is truncated")
        return data

    def read_all(self, out: torch.Tensor) -> torch.Tensor:
        """Every layer into ``out`` ``[layers, 2, tokens, heads, dim]``, each verified as soon as it is read.

        One thread, in file order: the kernel's readahead already keeps the disk busy while a layer is
        hashed (xxh3, about 17 GB/s on one core here, a seventh of the read time). Handing the hashing
        to a second thread was measured no faster on the shared 2-core machine and slower under load
        (every hand-over waits for a core).
        """
        for i in range(self.meta.num_layers):
            self.read_layer(i, out[i])
        return out

    def _readinto(self, buf: memoryview, offset: int, what: str) -> None:
        """Fill ``buf`` from ``offset``."""
        self._f.seek(offset)
        got = 0
        while got < len(buf):
            n = self._f.readinto(buf[got:])
            if not n:
                raise CorruptEntryError(f"entry {self.meta.key}: file ends inside {what}")
            got += n

    def read_layer(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``i`` as ``[2, tokens, heads, dim]`` on CPU (into ``out`` when given), verified."""
        start, end = self._offsets[i]
        if end - start != self.meta.layer_nbytes:
            raise CorruptEntryError(f"entry {self.meta.key}: layer {i} spans {end - start} bytes")
        if out is None:
            out = torch.empty(self.meta.layer_shape, dtype=self.meta.dtype)
        self._readinto(tensor_bytes(out), self._base + start, f"layer {i}")
        self.meta.verify_layer(i, out)
        return out

    def read_ahead(self, i: int) -> None:
        """Ask the kernel to read layers from layer ``i``'s start in the background, before ``read_layer(i)``:
        the next layers are then on their way from the disk while the caller computes with this one, many
        requests in flight, instead of each ``readinto`` starting its own when asked. The window is
        ``i + 2`` layers up to ``READ_AHEAD_BYTES``: the first layers are waited for at once, and a full
        window in front of layer 0 delayed it by ~1 ms. It moves no file offset, so a reader thread calls
        it before waiting for another's read to end (results/fusion-h200-1201c measured it so). Advice
        only: where the kernel does not take it (or the file was closed meanwhile), the reads go on."""
        if not hasattr(os, "posix_fadvise") or not 0 <= i < len(self._offsets):
            return
        first, last = self._offsets[i]
        start = self._base + first
        end = min(start + min(READ_AHEAD_BYTES, (i + 2) * (last - first)), self._end)
        if end > start:
            with contextlib.suppress(OSError, ValueError):
                os.posix_fadvise(self._f.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> DiskEntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DiskTier(Tier):
    """Entries as files under ``root``, listed in ``root/manifest.sqlite``, LRU by last access.

    Reads to CPU fill buffers from ``read_pool`` (default: the process-wide ``shared_pool()``).
    A ``read_only`` tier (a store on a read-only mount) serves what is listed and writes nothing: no
    put, no last-access update, no sweep; an entry failing its checksum is hidden from this process
    instead of removed, so it is recomputed, never served.
    """

    persistent = True

    def __init__(
        self, root: str | Path, capacity_bytes: int, name: str = "disk", reserve_bytes: int = 64 << 20,
        read_pool: HostBufferPool | None = None, sweep: bool = True, read_only: bool = False,
    ) -> None:
        """``sweep=False`` opens the tier without removing what crashed writers left (``remove_leftovers``):
        for ``ragfuse store gc``, which reports what it removes and, with ``--dry-run``, removes nothing."""
        self.name = name
        self.read_pool = read_pool if read_pool is not None else shared_pool()
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.reserve_bytes = reserve_bytes
        self.read_only = read_only
        self._hidden: set[str] = set()  # entries a read-only tier dropped (it cannot remove them)
        self._lock = FileLock(str(self.root / ".lock"))
        self._db_lock = threading.Lock()
        self._stats = TierStats(capacity=self.capacity_bytes)
        self._staging: list[torch.Tensor] | None = None  # page-locked buffers for reads to a GPU
        self._staging_lock = threading.Lock()  # one reader at a time in them (reads run on worker threads)
        if read_only:
            self._db = self._connect_read_only(self.root / "manifest.sqlite")
            return
        try:
            (self.root / "data").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KVStoreError(f"cannot create KV store directory {self.root}: {exc.strerror}") from exc
        with self._lock:
            self._open_manifest(sweep)

    # ---- housekeeping ------------------------------------------------------------------------

    def _open_manifest(self, sweep: bool) -> None:
        """Open the manifest (the caller holds the file lock) and sweep. One SQLite finds damaged (not
        a database, malformed) is set aside and rebuilt from the entry files; errors that say nothing
        of the file (locked, no permission, I/O) are a KVStoreError, and the manifest is left alone."""
        path = self.root / "manifest.sqlite"
        try:
            try:
                self._db = self._connect(path)
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError as exc:
                aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(f"{path}{suffix}", f"{aside}{suffix}")
                log.warning("KV manifest %s is damaged (%s): moved to %s, listing the entry files anew",
                            path, exc, aside.name)
                self._db = self._connect(path)
                self._relist()
        except (sqlite3.Error, OSError) as exc:
            raise KVStoreError(f"cannot open the KV manifest {path}: {exc}") from exc
        if sweep:
            self.remove_leftovers()

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        """The manifest, its table created where new and read through once (damage shows here)."""
        db = sqlite3.connect(path, timeout=60, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, file TEXT NOT NULL,"
                " nbytes INTEGER NOT NULL, checksum TEXT NOT NULL, num_tokens INTEGER NOT NULL,"
                " created REAL NOT NULL, last_access REAL NOT NULL)"
            )
            db.execute("CREATE INDEX IF NOT EXISTS entries_lru ON entries(last_access)")
            db.execute("SELECT COUNT(*), SUM(nbytes) FROM entries").fetchall()
        except BaseException:
            db.close()
            raise
        return db

    @classmethod
    def _connect_read_only(cls, path: Path) -> sqlite3.Connection | ReadOnlyDatabase:
        """The manifest as it is, kept up with a writer behind the mount (``ReadOnlyDatabase``); an
        empty one in memory where there is none (a store ingested without KV)."""
        if not path.exists():
            return cls._connect(Path(":memory:"))
        try:
            return ReadOnlyDatabase(path, "SELECT COUNT(*), SUM(nbytes) FROM entries")
        except sqlite3.Error as exc:
            raise KVStoreError(f"cannot read the KV manifest {path} (read-only): {exc}") from exc

    def _read_only_error(self) -> KVStoreError:
        return KVStoreError(f"the KV store {self.root} is read-only: nothing is stored there")

    def _relist(self) -> None:
        """List every entry file whose header reads, under the key it names (last access: its mtime).
        Files that do not read are left unlisted, for the sweep to remove."""
        for path in (self.root / "data").glob("*/*.safetensors"):
            try:
                with DiskEntryReader(path, None) as reader:
                    meta = reader.meta
                st = path.stat()
            except (CorruptEntryError, OSError):
                continue
            if path != self._path(meta.key):
                continue
            self._sql("INSERT OR REPLACE INTO entries (key, file, nbytes, checksum, num_tokens, created, last_access)"
                      " VALUES (?, ?, ?, ?, ?, ?, ?)", (meta.key, str(path.relative_to(self.root)), st.st_size,
                                                        meta.checksum, meta.num_tokens, st.st_mtime, st.st_mtime))

    def remove_leftovers(self, temp_max_age: float | None = None, dry_run: bool = False,
                         ) -> tuple[list[tuple[Path, int]], list[str]]:
        """Remove what crashed writers left, under the lock (a put holds it from its rename to its
        listing, so nothing found here is a live put's); return the files removed with their sizes,
        and the keys of rows whose file was gone. ``dry_run``: remove nothing, return what would go.
        A read-only tier removes nothing; a dry run reports what a writer's sweep would remove.

        - entry files the manifest does not list (a crash between the rename and the listing);
        - temp files of dead writers (a crash mid-write): the pid in the name runs no process here,
          or, with ``temp_max_age``, the file was last written more than that many seconds ago. A put
          writes its temp file in one go and renames it as soon as it has the lock, so an old one is
          dead even where its pid now belongs to another process (the pid test alone keeps it forever);
        - rows whose entry file is gone (removed behind the manifest's back)."""
        removed: list[tuple[Path, int]] = []
        if self.read_only and not dry_run:
            return removed, []
        with contextlib.nullcontext() if self.read_only else self._lock:  # no lock file on a read-only mount
            listed = {row[0] for row in self._sql("SELECT file FROM entries")}
            for path in (self.root / "data").glob("*/*"):
                if path.name.endswith(".tmp"):
                    dead = not pid_alive(_writer_pid(path.name)) or (
                        temp_max_age is not None and untouched_for(path) > temp_max_age)
                else:
                    dead = str(path.relative_to(self.root)) not in listed
                if dead:
                    with contextlib.suppress(FileNotFoundError):
                        removed.append((path, path.stat().st_size))
                        if not dry_run:
                            path.unlink()
            gone = [key for key, file in self._sql("SELECT key, file FROM entries") if not (self.root / file).exists()]
            if not dry_run:
                for key in gone:
                    self._sql("DELETE FROM entries WHERE key=?", (key,))
        return removed, gone

    def _sql(self, query: str, args: tuple = ()) -> list[tuple]:
        with self._db_lock:
            return self._db.execute(query, args).fetchall()

    def _path(self, key: str) -> Path:
        return self.root / "data" / key[:2] / f"{key}.safetensors"

    # ---- reads -------------------------------------------------------------------------------

    def open(self, key: str) -> DiskEntryReader | None:
        """A layer-by-layer reader of ``key``, or None when absent. Counts a hit; the caller must
        call ``drop(key)`` if a layer later fails its checksum. An entry whose file does not open as
        one (empty, a damaged header) is dropped and raises ``CorruptEntryError``: the caller says
        that what it recomputes replaces damaged KV, not KV that was never stored."""
        rows = self._sql("SELECT file, checksum FROM entries WHERE key=?", (key,)) if key not in self._hidden else []
        if not rows:
            self._stats.misses += 1
            return None
        try:
            reader = DiskEntryReader(self.root / rows[0][0], rows[0][1])
        except FileNotFoundError:  # evicted by another process since the lookup, or removed behind our back
            self._stats.misses += 1
            self._listed(key)
            return None
        except CorruptEntryError:
            self.drop(key)
            raise
        self._stats.hits += 1
        if not self.read_only:
            self._sql("UPDATE entries SET last_access=? WHERE key=?", (time.time(), key))
        return reader

    def get(self, key: str, device: torch.device | None = None) -> StoredKV | None:
        try:
            reader = self.open(key)
        except CorruptEntryError:  # dropped: a miss to this caller
            return None
        if reader is None:
            return None
        device = torch.device(device or "cpu")
        with reader:
            try:
                layers = self._read_to_gpu(reader, device) if device.type == "cuda" else self._read_to_cpu(reader)
            except CorruptEntryError:
                self._stats.hits -= 1
                self.drop(key)
                return None
        return StoredKV(reader.meta, layers)

    def _read_to_cpu(self, reader: DiskEntryReader) -> list[torch.Tensor]:
        meta = reader.meta
        whole = self.read_pool.take(meta.nbytes).view(meta.dtype).view(meta.num_layers, *meta.layer_shape)
        return list(reader.read_all(whole).unbind(0))

    def _read_to_gpu(self, reader: DiskEntryReader, device: torch.device) -> list[torch.Tensor]:
        """Read each layer into one of two page-locked staging buffers and copy it to the GPU
        asynchronously, so the disk read of layer i+1 overlaps the copy of layer i."""
        meta = reader.meta
        nbytes = meta.layer_nbytes
        out = torch.empty((meta.num_layers, *meta.layer_shape), dtype=meta.dtype, device=device)
        with self._staging_lock:
            if self._staging is None or self._staging[0].numel() < nbytes:
                self._staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            done: list[torch.cuda.Event | None] = [None, None]
            for i in range(meta.num_layers):
                slot = i % 2
                if done[slot] is not None:
                    done[slot].synchronize()  # the copy out of this buffer has finished
                buf = self._staging[slot][:nbytes].view(meta.dtype).view(meta.layer_shape)
                reader.read_layer(i, buf)
                out[i].copy_(buf, non_blocking=True)
                done[slot] = torch.cuda.Event()
                done[slot].record()
            torch.cuda.current_stream(device).synchronize()
        return list(out.unbind(0))

    # ---- writes ------------------------------------------------------------------------------

    def put(self, entry: StoredKV, keep_evicted: bool = True) -> list[StoredKV]:
        if self.read_only:  # an entry it holds is stored already (a memory tier's eviction is no loss)
            if self.contains(entry.key):
                return []
            raise self._read_only_error()
        if self._listed(entry.key):
            return []
        tensors = {layer_name(i): t.to("cpu").contiguous() for i, t in enumerate(entry.layers)}
        blob = safetensors_save(tensors, metadata={META_FIELD: json.dumps(entry.meta.to_json())})
        if len(blob) > self.capacity_bytes:
            return [entry]
        free = shutil.disk_usage(self.root).free
        if free < len(blob) + self.reserve_bytes:
            raise DiskFullError(
                f"no room on disk for a KV entry of {len(blob) / 2**20:.1f} MiB in {self.root} "
                f"({free / 2**20:.0f} MiB free, {self.reserve_bytes / 2**20:.0f} MiB kept in reserve)"
            )
        final = self._path(entry.key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".{entry.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            _write_durably(tmp, blob)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _FULL_ERRNOS:
                raise DiskFullError(f"disk full while writing a KV entry to {self.root}: {exc.strerror}") from exc
            raise KVStoreError(f"cannot write a KV entry to {self.root}: {exc.strerror}") from exc
        evicted_keys: list[tuple[str, str]] = []
        with self._lock:
            if self._listed(entry.key):  # another process stored it meanwhile
                tmp.unlink(missing_ok=True)
                return []
            used = self._sql("SELECT COALESCE(SUM(nbytes), 0) FROM entries")[0][0]
            for key, file, nbytes in self._sql("SELECT key, file, nbytes FROM entries ORDER BY last_access"):
                if used + len(blob) <= self.capacity_bytes:
                    break
                evicted_keys.append((key, file))
                used -= nbytes
            evicted = [e for k, _ in evicted_keys if keep_evicted and (e := self._read_for_demotion(k)) is not None]
            for key, file in evicted_keys:
                self._sql("DELETE FROM entries WHERE key=?", (key,))
                (self.root / file).unlink(missing_ok=True)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
            now = time.time()
            self._sql(
                "INSERT INTO entries (key, file, nbytes, checksum, num_tokens, created, last_access)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (entry.key, str(final.relative_to(self.root)), len(blob), entry.meta.checksum,
                 entry.meta.num_tokens, now, now),
            )
        self._stats.evictions += len(evicted_keys)
        return evicted

    def _read_for_demotion(self, key: str) -> StoredKV | None:
        rows = self._sql("SELECT file, checksum FROM entries WHERE key=?", (key,))
        try:
            with DiskEntryReader(self.root / rows[0][0], rows[0][1]) as r:
                return StoredKV(r.meta, [r.read_layer(i) for i in range(r.meta.num_layers)])
        except (CorruptEntryError, FileNotFoundError, IndexError):
            return None

    def contains(self, key: str) -> bool:
        """Whether ``key`` is listed with its file in place: an entry whose file was removed behind the
        manifest's back is no entry (a re-ingest computes it again, instead of finding it stored);
        its row goes at the next ``put`` of the key (``_listed``) or the next opener's sweep."""
        rows = self._sql("SELECT file FROM entries WHERE key=?", (key,)) if key not in self._hidden else []
        return bool(rows) and (self.root / rows[0][0]).exists()

    def _listed(self, key: str) -> bool:
        """Whether ``key`` is listed with its file in place. A row whose file is gone (removed
        behind the manifest's back) is deleted, under the lock, where a put lists a file only once
        it is in place: left, it would keep the entry from ever being stored again and count toward
        the capacity."""
        if not self._sql("SELECT 1 FROM entries WHERE key=?", (key,)):
            return False
        with self._lock:
            rows = self._sql("SELECT file FROM entries WHERE key=?", (key,))
            if rows and not (self.root / rows[0][0]).exists():
                self._sql("DELETE FROM entries WHERE key=?", (key,))
                log.warning("KV entry %s was listed but its file %s is gone: unlisted", key, rows[0][0])
                return False
            return bool(rows)

    def delete(self, key: str) -> bool:
        if self.read_only:  # hidden from this process: what it cannot remove, it does not serve
            listed = self.contains(key)
            self._hidden.add(key)
            return listed
        with self._lock:
            rows = self._sql("SELECT file FROM entries WHERE key=?", (key,))
            self._sql("DELETE FROM entries WHERE key=?", (key,))
            for (file,) in rows:
                (self.root / file).unlink(missing_ok=True)
        return bool(rows)

    def entry_keys(self) -> list[str]:
        return [k for (k,) in self._sql("SELECT key FROM entries ORDER BY last_access")]

    def entry_sizes(self) -> dict[str, int]:
        """Bytes of each listed entry's file, by key."""
        return dict(self._sql("SELECT key, nbytes FROM entries"))

    def intact(self, key: str) -> bool | None:
        """Whether every layer of ``key`` reads and matches its checksum (None: no such entry, e.g.
        evicted meanwhile). Reads it all, without counting a hit or refreshing its last access: a scan
        of the whole tier must not make every entry look recently used."""
        rows = self._sql("SELECT file, checksum FROM entries WHERE key=?", (key,))
        if not rows:
            return None
        try:
            with DiskEntryReader(self.root / rows[0][0], rows[0][1]) as reader:
                layer = torch.empty(reader.meta.layer_shape, dtype=reader.meta.dtype)
                for i in range(reader.meta.num_layers):
                    reader.read_layer(i, layer)
        except FileNotFoundError:
            return None
        except CorruptEntryError:
            return False
        except OSError as exc:  # the disk failing is no verdict on the entry: the caller is told, the entry kept
            raise UnreadableEntryError(f"cannot read KV entry {key} in {self.root}: {exc.strerror or exc}",
                                       key) from exc
        return True

    def path_of(self, key: str) -> Path | None:
        rows = self._sql("SELECT file FROM entries WHERE key=?", (key,))
        return self.root / rows[0][0] if rows else None

    def drop_cache(self, key: str) -> None:
        path = self.path_of(key)
        if path is not None:
            with contextlib.suppress(OSError):
                drop_page_cache(path)

    def stats(self) -> TierStats:
        n, total = self._sql("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM entries")[0]
        self._stats.entries, self._stats.bytes = n, total
        return self._stats

    def close(self) -> None:
        with self._db_lock:
            self._db.close()


def _write_durably(path: Path, blob: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(blob)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        drop_page_cache(path)  # written once, read rarely: do not let ingest evict the page cache


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer_pid(name: str) -> int:
    """The pid in a temp file's name (``.{key}.{pid}.{random}.tmp``), or -1 where it holds none."""
    parts = name.split(".")
    return int(parts[-3]) if len(parts) >= 5 and parts[-3].isdigit() else -1


def untouched_for(path: Path) -> float:
    """Seconds since ``path`` was last written; 0 where it is already gone (nothing left to remove)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
