"""The session store: each conversation's KV in host memory and on disk, saved in the background.

Entries use the tiered KV store's format (``StoredKV``: per-layer tensors with xxh3 checksums; the
disk tier's crash-safe safetensors files), keyed by model, dtype, session id and tokens. A small
JSON record per session (its logical tokens and which of them the stored rows are) sits beside the
files, so sessions survive the process. Placement (which session is where, what to evict, what to
prefetch) is ``SessionPlacement``'s decision; this class carries the moves out:

- saving: the snapshot's host copy becomes the memory copy as soon as its copy event fires (on the
  saver thread); the disk write follows on the I/O thread. The next turn of the same session waits
  only for the memory copy, never for the disk;
- prefetch: ``hint(queue)`` (the engine's waiting sessions, head first) reads the sessions of the
  look-ahead window from disk into memory on the I/O thread, before their jobs start;
- a lookup never serves a session whose bytes fail their checksum, or whose record on disk does not
  hold together (``record_problem``): the session is forgotten and the caller recomputes (and says so);
- a turn is registered when it begins (``begin``): deleting its session while it runs drops its save,
  so a deleted session does not come back when the turn finishes;
- a session's KV file is only kept while a record refers to it: a failed record write deletes it, and
  opening the store removes files left without a record (a process that died between the two writes).
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..atomic_file import write_atomic
from ..errors import RequestError
from ..folder_lock import FolderLock
from ..kvstore import CorruptEntryError, DiskTier, KVStoreError, StoredKV, kv_key
from ..kvstore.entry import DTYPES, EntryMeta, dtype_name, layer_checksum
from .history import Ranges, total
from .placement import Move, SessionInfo, SessionPlacement, make_policy
from .snapshot import Snapshot
from .source import SessionCorruptError, SessionSource, disk_source, memory_source

log = logging.getLogger("ragfuse.sessions")
# A session id names its record file and travels in URLs: the one rule for the store, the CLI and the
# server's request schemas. Anchored because pydantic searches a pattern; Python code fullmatches it.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.:@-]{1,128}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
# a KV file without a record is left alone this long: another process sharing the directory may be
# between writing a session's KV and its record
ORPHAN_GRACE_S = 600.0
# why a session is gone is kept for this many of the sessions forgotten last (its next turn's note):
# a server seeing ever-new session ids evicts one for each admitted past the byte bounds, and kept for
# every one the reasons grew with the requests served; a few MB at most (ids are up to 128 characters)
GONE_REASONS_KEPT = 10_000


def check_session_id(session_id: str) -> str:
    """``session_id`` if it is a valid id (``SESSION_ID_PATTERN``, the whole string: "a\\n" is not one)."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise RequestError(f"session id {session_id!r} must be 1-128 letters, digits or _.:@-")
    return session_id


def session_key(fingerprint: str, dtype: torch.dtype, session_id: str, tokens: list[int]) -> str:
    """The KV store key of a session's KV over its logical ``tokens``."""
    return kv_key(f"{fingerprint}\0session\0{session_id}", dtype, tokens)


@dataclass
class SessionRecord:
    """A saved session: ``tokens`` are its logical tokens (the whole conversation so far), and
    ``ranges`` the logical indices of its stored rows, in order."""

    session_id: str
    key: str
    tokens: list[int]
    ranges: Ranges
    num_rows: int
    nbytes: int
    created: float
    fingerprint: str
    dtype: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SessionRecord:
        d = json.loads(text)
        d["ranges"] = [tuple(r) for r in d["ranges"]]
        return cls(**d)


def record_problem(rec: SessionRecord, name: str) -> str:
    """Why a record read from ``records/{name}.json`` cannot be served ("" when it holds together).

    The KV file is checksummed, the record beside it is not: a damaged ``ranges`` would put the stored
    rows at the wrong logical positions, damaged ``tokens`` would pair the KV with other tokens. So the
    record must name itself, its key must be the key of its tokens, and its ranges must be sorted,
    disjoint, within the tokens and cover exactly its ``num_rows`` (checked against the KV file itself
    when it is opened, ``SessionStore._open_disk``)."""
    if rec.session_id != name or not _SESSION_ID.fullmatch(rec.session_id):
        return f"it names session {rec.session_id!r}"
    if rec.dtype not in DTYPES or not isinstance(rec.fingerprint, str):
        return f"unknown model fingerprint or dtype ({rec.dtype!r})"
    if not isinstance(rec.tokens, list) or not all(type(t) is int and 0 <= t < 1 << 63 for t in rec.tokens):
        return "its tokens are not token ids"
    if rec.key != session_key(rec.fingerprint, DTYPES[rec.dtype], rec.session_id, rec.tokens):
        return "its key is not the key of its tokens"
    end = 0
    for r in rec.ranges:
        if len(r) != 2 or not all(type(i) is int for i in r) or not end <= r[0] < r[1] <= len(rec.tokens):
            return f"its ranges {rec.ranges} are not sorted ranges of its {len(rec.tokens)} tokens"
        end = r[1]
    if not rec.ranges or total(rec.ranges) != rec.num_rows:
        return f"its ranges {rec.ranges} do not cover its {rec.num_rows} stored rows"
    if type(rec.nbytes) is not int or rec.nbytes <= 0 or not isinstance(rec.created, (int, float)):
        return f"its size {rec.nbytes!r} or creation time {rec.created!r} is not one"
    return ""


def _rows_mismatch(rec: SessionRecord, meta: EntryMeta) -> str:
    """Why the KV read for ``rec`` does not belong to it ("" when it does)."""
    if meta.num_tokens != rec.num_rows:
        return f"has {meta.num_tokens} stored rows on disk where its record says {rec.num_rows}"
    return ""


@dataclass(eq=False)
class TurnTicket:
    """A session turn from its start (``SessionStore.begin``) to its save. The turn holds it; the
    store only refers to it weakly, so a turn that is dropped unsaved (aborted) leaves nothing behind.
    ``conversation`` is the turn's logical tokens before its answer: its save's tokens start with them."""

    session_id: str
    conversation: list[int]
    deleted: bool = False  # the session was deleted while the turn ran: its save is dropped


@dataclass(frozen=True)
class SessionSummary:
    """What a listing shows of a stored session (``SessionStore.sessions``)."""

    session_id: str
    tokens: int  # logical tokens of the conversation so far
    stored_rows: int  # of them, rows whose KV is stored (fewer after a context overflow cut)
    nbytes: int
    tier: str | None  # "cpu" (host memory, and disk when there is a disk tier) or "disk"
    created: float
    last_access: float


@dataclass
class Lookup:
    record: SessionRecord | None
    tier: str | None
    reason: str  # why nothing was found ("" on a hit)
    open_source: Callable[[int, list[int] | None], SessionSource] | None = None


class SessionStore:
    def __init__(
        self,
        root: str | Path | None,
        fingerprint: str,
        dtype: torch.dtype,
        cpu_bytes: int = 4 << 30,
        disk_bytes: int = 32 << 30,
        policy: str = "scheduler",
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        hold: bool | FolderLock = True,
        read_only: bool = False,
    ) -> None:
        """``hold``: keep the folder's sessions to this process (``FolderLock``) while it is open, or
        the lock a caller took before loading a model (``hold_sessions``: a refusal comes at once); a
        store that only lists them (``browse``) holds nothing. ``read_only``: a listing of a folder this
        process cannot write (a read-only store's), which changes nothing there, damaged records and
        orphaned KV included."""
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.clock = clock
        self.root = Path(root) if root is not None else None
        self.placement = SessionPlacement(cpu_bytes, disk_bytes if root is not None else 0, make_policy(policy), ttl_s)
        self.disk: DiskTier | None = None
        self._folder: FolderLock | None = None
        if self.root is not None:
            if isinstance(hold, FolderLock):
                self._folder = hold
            elif hold:
                self._folder = hold_sessions(self.root)
            try:
                # the placement decides disk evictions; the tier's own LRU must never fire first
                self.disk = DiskTier(self.root / "kv", capacity_bytes=2 * disk_bytes + (1 << 30), name="disk",
                                     reserve_bytes=0, read_only=read_only)
                if not read_only:
                    (self.root / "records").mkdir(parents=True, exist_ok=True)
            except BaseException:
                if self._folder is not None:
                    self._folder.release()
                raise
        self._records: dict[str, SessionRecord] = {}
        self._memory: dict[str, StoredKV] = {}
        self._gone: dict[str, str] = {}  # why a session known earlier is not there any more
        self._lock = threading.RLock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="ragfuse-session-save")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ragfuse-session-io")
        self._saving: dict[str, Future[None]] = {}
        self._io_pending: dict[str, Future[None]] = {}
        # turns begun and not saved yet, by when they began (``begin``)
        self._turns: weakref.WeakValueDictionary[int, TurnTicket] = weakref.WeakValueDictionary()
        self._turn_ids = itertools.count()
        self._lookahead: list[str] = []  # the sessions a caller said come next (``hint``)
        self._pins: dict[str, int] = {}  # open layer sources per session (``placement.pinned``: those > 0)
        self.read_only = read_only
        self._load_records()
        if not read_only:
            self._remove_orphans()

    # ---- records on disk -----------------------------------------------------------------------

    @classmethod
    def browse(cls, root: str | Path, hold: bool = False) -> SessionStore:
        """The sessions saved under ``root`` by any model, to list, or with ``hold`` to delete
        (``ragfuse session``), without loading one: this store has no model's fingerprint, so it must
        save no turn. A listing holds nothing (it may run beside a server); a delete must hold the
        folder, or the process serving the session would save it again from memory. A listing of a
        folder this process cannot write (a read-only store's) reads it as it is."""
        read_only = not hold and Path(root).is_dir() and not os.access(root, os.W_OK)
        return cls(root, fingerprint="", dtype=torch.float32, cpu_bytes=0, hold=hold, read_only=read_only)

    def _record_path(self, session_id: str) -> Path:
        assert self.root is not None
        return self.root / "records" / f"{session_id}.json"

    def _load_records(self) -> None:
        """Sessions saved by earlier processes: on disk, not in memory. A damaged record is dropped
        (its KV file goes with the orphans), and the session's next turn says why it recomputes."""
        if self.root is None or self.disk is None:
            return
        for path in sorted((self.root / "records").glob("*.json")):
            try:
                rec = SessionRecord.from_json(path.read_text())
                why = record_problem(rec, path.stem)
            except (ValueError, TypeError, KeyError) as exc:
                why = f"unreadable ({exc})"
            if why:
                log.warning("session record %s is damaged (%s): dropped, its next turn recomputes", path, why)
                if not self.read_only:
                    path.unlink(missing_ok=True)
                if _SESSION_ID.fullmatch(path.stem):
                    self._note_gone(path.stem, "had a damaged record on disk")
                continue
            # a record whose KV file is gone stays: its tokens are the history (all a RAG session has of
            # it), which the session's next turn recomputes, saying why, when the file does not open
            self._records[rec.session_id] = rec
            self.placement.sessions[rec.session_id] = SessionInfo(
                rec.session_id, rec.nbytes, rec.created, path.stat().st_mtime, on_disk=True
            )

    def _remove_orphans(self) -> None:
        """Delete session KV files that no record refers to and that are older than ``ORPHAN_GRACE_S``:
        left by a process that died between writing a session's KV and its record, or whose disk
        refused both the record and the KV's deletion. Nothing else would ever remove them."""
        if self.disk is None:
            return
        live = {rec.key for rec in self._records.values()}
        cutoff = time.time() - ORPHAN_GRACE_S  # file times are wall-clock times, whatever ``clock`` is
        for key in self.disk.entry_keys():
            path = self.disk.path_of(key)
            if key in live or path is None:
                continue
            try:
                old = path.stat().st_mtime < cutoff
            except FileNotFoundError:  # deleted meanwhile by another process
                continue
            if old:
                log.info("session KV file %s has no record: removed", path.name)
                self.disk.delete(key)

    # ---- turns ---------------------------------------------------------------------------------

    def begin(self, session_id: str, conversation: list[int]) -> TurnTicket:
        """Register a turn of ``session_id`` over ``conversation`` (its logical tokens before the
        answer); the turn keeps the ticket until it is saved (``save`` finds it by those tokens)."""
        ticket = TurnTicket(check_session_id(session_id), conversation)
        with self._lock:
            self._turns[next(self._turn_ids)] = ticket
        return ticket

    def _claim(self, session_id: str, tokens: list[int]) -> TurnTicket | None:
        """The running turn that a save of ``tokens`` finishes (removed from the running ones): of the
        session's turns whose conversation starts ``tokens``, the longest, the earliest begun among
        equals (two turns over the same conversation save the same tokens but for the answer). None
        for a save that no registered turn made (the store used on its own). Called under the lock."""
        best: tuple[int, TurnTicket] | None = None
        for n, t in list(self._turns.items()):
            m = len(t.conversation)
            if t.session_id != session_id or m > len(tokens) or (best is not None and m <= len(best[1].conversation)):
                continue
            if tokens[:m] == t.conversation:
                best = (n, t)
        if best is None:
            return None
        self._turns.pop(best[0], None)
        return best[1]

    # ---- saving --------------------------------------------------------------------------------

    def save(self, session_id: str, tokens: list[int], ranges: Ranges, snapshot: Snapshot,
             queue: Sequence[str] = ()) -> Future[None]:
        """Save a turn's KV (``snapshot``, rows for ``ranges`` of the logical ``tokens``) in the
        background; returns when the work is queued. The save of a turn that began before its session
        was deleted is dropped (the returned future is done): the deleted conversation stays deleted."""
        check_session_id(session_id)
        with self._lock:
            ticket = self._claim(session_id, tokens)
        if ticket is not None and ticket.deleted:
            log.info("session %s was deleted while a turn of it ran: that turn is not saved", session_id)
            dropped: Future[None] = Future()
            dropped.set_result(None)
            return dropped
        created = self._records[session_id].created if session_id in self._records else self.clock()
        with self._lock:
            # the engine's waiting turns, then those a caller said come next (``hint``; a job queue
            # served one turn at a time has no waiting turn in the engine), as they are now: the save
            # runs later, when the next turn may have begun and hinted what follows it
            ahead = [*queue, *(s for s in self._lookahead if s not in queue and s != session_id)]

        def work() -> None:
            layers = snapshot.wait()
            key = session_key(self.fingerprint, self.dtype, session_id, tokens)
            meta = EntryMeta(key=key, num_layers=layers.shape[0], num_tokens=layers.shape[2],
                             num_kv_heads=layers.shape[3], head_dim=layers.shape[4], dtype=layers.dtype,
                             layer_checksums=tuple(layer_checksum(t) for t in layers))
            entry = StoredKV(meta, list(layers.unbind(0)))
            rec = SessionRecord(session_id, key, list(tokens), list(ranges), meta.num_tokens, meta.nbytes, created,
                                self.fingerprint, dtype_name(self.dtype))
            with self._lock:
                moves = self.placement.admit(session_id, entry.nbytes, self.clock(), ahead)
                self._apply(moves, new=(rec, entry))

        with self._lock:
            fut = self._saver.submit(work)
            self._pending(self._saving, session_id, fut)
        return fut

    def _pending(self, table: dict[str, Future[None]], session_id: str, fut: Future[None]) -> None:
        """Record ``fut`` as the session's latest save or disk move in ``table`` (``_saving``,
        ``_io_pending``), which a lookup of the session waits for; it leaves once done, unless it
        failed: then the session's next lookup (or ``flush``) raises its error. Left there, every
        session ever saved kept its entries, so a server seeing ever-new session ids grew them with
        each request, and ``flush``/``sessions`` waited on all of them. Called under the lock."""
        table[session_id] = fut

        def done(f: Future[None]) -> None:
            if f.cancelled() or f.exception() is None:
                with self._lock:
                    if table.get(session_id) is f:
                        del table[session_id]

        fut.add_done_callback(done)

    def _apply(self, moves: list[Move], new: tuple[SessionRecord, StoredKV] | None = None) -> None:
        """Carry out placement moves (under the lock; disk work goes to the I/O thread, in order).
        ``new``: a session just admitted, whose record and memory copy are not registered yet."""
        superseded: SessionRecord | None = None  # the session's previous turn, replaced by ``new``
        if new is not None:
            rec, entry = new
            superseded = self._records.get(rec.session_id)
            if superseded is not None:
                self._memory.pop(rec.session_id, None)
            self._records[rec.session_id] = rec
            self._memory[rec.session_id] = entry
            self._gone.pop(rec.session_id, None)
        for move in moves:
            sid = move.session_id
            rec = self._records.get(sid)
            if move.action == "forget":
                self._forget(sid, "evicted from every tier")
            elif move.action == "uncache":
                self._memory.pop(sid, None)
            elif move.action == "unpersist" and rec is not None:
                self._io_submit(sid, lambda r=rec: self._delete_files(r))
            elif move.action == "persist" and rec is not None and sid in self._memory:
                # the previous turn's files go once the new ones are written: they are the fallback
                old = superseded if new is not None and sid == new[0].session_id else None
                if old is not None:
                    superseded = None
                self._io_submit(sid, lambda r=rec, e=self._memory[sid], o=old: self._write_files(r, e, o))
            elif move.action == "fetch" and rec is not None:
                self._io_submit(sid, lambda r=rec: self._fetch(r))
        if superseded is not None:  # the new turn is not written to disk: nothing to fall back on
            self._io_submit(superseded.session_id, lambda r=superseded: self._delete_files(r))
        if new is not None:
            info = self.placement.sessions.get(new[0].session_id)
            if info is not None and not info.in_cpu:
                self._memory.pop(new[0].session_id, None)  # written to disk only (larger than memory)

    def _io_submit(self, session_id: str, fn: Callable[[], None]) -> None:
        self._pending(self._io_pending, session_id, self._io.submit(fn))

    def _write_files(self, rec: SessionRecord, entry: StoredKV, old: SessionRecord | None = None) -> None:
        """Persist a session (on the I/O thread), then delete the files of the turn it supersedes
        (``old``). A disk that cannot take it (full, failing) costs the durable copy only, while
        memory holds the session; else the session falls back to ``old``, still whole on disk (its
        next turn reuses that shorter history), or, without one, is lost as an eviction would lose
        it, with the reason. Raised here, the error would resurface at every later lookup and at
        close, and the session could never be used or replaced."""
        assert self.disk is not None and self.root is not None
        kv_written = False
        try:
            self.disk.put(entry, keep_evicted=False)
            kv_written = True
            write_atomic(self._record_path(rec.session_id), rec.to_json())
            if old is not None and old.key != rec.key:
                self._delete_files(old)
        except (KVStoreError, OSError) as exc:
            log.warning("session %s could not be written to disk: %s", rec.session_id, exc)
            if kv_written:  # no record refers to the KV file: nothing would ever delete it
                try:
                    self.disk.delete(entry.key)
                except (OSError, sqlite3.Error) as del_exc:  # the next opening of the store removes it
                    log.warning("session %s: its KV file without a record stays until restart: %s",
                                rec.session_id, del_exc)
            with self._lock:
                current = self._records.get(rec.session_id) is rec
                if current and not (rec.session_id in self._memory
                                    and self.placement.disk_write_failed(rec.session_id)):
                    if old is not None and self._fall_back(old):
                        log.warning("session %s keeps its previous turn (%d tokens) from disk",
                                    rec.session_id, len(old.tokens))
                        return
                    self._forget(rec.session_id, f"could not be written to disk ({exc})")
            if old is not None and old.key != rec.key:  # a later turn or memory holds the session now
                self._delete_files(old)

    def _fall_back(self, old: SessionRecord) -> bool:
        """Serve ``old`` (the turn before one whose disk write failed) again, if its KV file is still
        on disk; its record file was never replaced. Called under the lock."""
        assert self.disk is not None
        if not self.disk.contains(old.key):
            return False
        self._records[old.session_id] = old
        self._memory.pop(old.session_id, None)
        self.placement.sessions[old.session_id] = SessionInfo(old.session_id, old.nbytes, old.created,
                                                              self.clock(), on_disk=True)
        return True

    def _delete_files(self, rec: SessionRecord) -> None:
        if self.disk is None:
            return
        self.disk.delete(rec.key)
        path = self._record_path(rec.session_id)
        current = self._records.get(rec.session_id)
        if current is None or current.key == rec.key:
            path.unlink(missing_ok=True)

    def _fetch(self, rec: SessionRecord) -> None:
        """Disk -> host memory ahead of the session's job (prefetch)."""
        assert self.disk is not None
        entry = self.disk.get(rec.key)
        with self._lock:
            info = self.placement.sessions.get(rec.session_id)
            if entry is None:
                self._forget(rec.session_id, "failed its checksum on disk")
            elif why := _rows_mismatch(rec, entry.meta):
                self._forget(rec.session_id, why)
            elif info is not None and info.in_cpu and self._records.get(rec.session_id) is rec:
                self._memory[rec.session_id] = entry.to("cpu", pin=torch.cuda.is_available())

    # ---- loading -------------------------------------------------------------------------------

    def _settle_save(self, session_id: str) -> None:
        """Check the id, then wait for the session's pending save (if any) to reach host memory, so
        what follows sees the turn's KV rather than the turn before it."""
        check_session_id(session_id)
        with self._lock:
            saving = self._saving.pop(session_id, None)
        if saving is not None:
            saving.result()

    def lookup(self, session_id: str) -> Lookup:
        """Where the session is, and a way to open its rows as a layer source. Waits for the
        session's own save to reach host memory (and for a disk move of it in flight)."""
        self._settle_save(session_id)
        with self._lock:
            for move in self.placement.expire(self.clock()):
                self._forget(move.session_id, "expired (TTL)")
            pending = self._io_pending.get(session_id)
        if pending is not None and session_id not in self._memory:
            pending.result()  # a failed write may fall back to the previous turn: read the record after it
        with self._lock:
            rec = self._records.get(session_id)
        if rec is None:
            reason = self._gone.get(session_id)
            return Lookup(None, None, f"session {session_id} {reason}" if reason else "")
        if rec.fingerprint != self.fingerprint or rec.dtype != dtype_name(self.dtype):
            return Lookup(None, None, f"session {session_id} was saved by another model or dtype")
        with self._lock:
            tier = self.placement.access(session_id, self.clock())
            entry = self._memory.get(session_id)
        if entry is not None:
            layers = entry.layers
            return Lookup(rec, "cpu", "", lambda n, rows: memory_source(layers, n, rows, session_id,
                                                                        self._pin(session_id)))
        if tier is None or self.disk is None:
            return Lookup(None, None, f"session {session_id} is not stored")
        return Lookup(rec, "disk", "", lambda n, rows: self._open_disk(rec, n, rows))

    def _open_disk(self, rec: SessionRecord, num_tokens: int, rows: list[int] | None) -> SessionSource:
        """The session's KV file as a layer source; ``SessionCorruptError`` when it is missing, does not
        read (truncated, damaged header) or holds other rows than its record says (the caller drops
        the session and recomputes, ``begin_turn``)."""
        assert self.disk is not None
        try:
            reader = self.disk.open(rec.key)
        except CorruptEntryError as exc:
            raise SessionCorruptError(rec.session_id, f"was not readable on disk ({exc})") from exc
        if reader is None:
            raise SessionCorruptError(rec.session_id, "was not readable on disk")
        if why := _rows_mismatch(rec, reader.meta):
            reader.close()
            raise SessionCorruptError(rec.session_id, why)
        return disk_source(reader, num_tokens, rows, rec.session_id, self._pin(rec.session_id))

    def _pin(self, session_id: str) -> Callable[[], None]:
        """Mark the session in use while a turn reads its KV (from its source's opening to its
        ``finish``, the read buffer's wait in the queue included) and return the unmarking. The
        placement neither evicts nor expires a session in use, and counts its bytes out of the
        prefetch window: an eviction would free nothing while the turn still holds the memory."""
        with self._lock:
            self._pins[session_id] = self._pins.get(session_id, 0) + 1
            self.placement.pinned.add(session_id)

        def unpin() -> None:
            with self._lock:
                left = self._pins.pop(session_id) - 1
                if left:
                    self._pins[session_id] = left
                else:
                    self.placement.pinned.discard(session_id)

        return unpin

    def conversation(self, session_id: str) -> list[int]:
        """The session's logical tokens so far (empty for a new or lost session), for a caller that
        appends its next turn to them."""
        return self.history(session_id)[0]

    def history(self, session_id: str) -> tuple[list[int], Ranges]:
        """The session's logical tokens so far and the ranges of them its stored rows hold (both
        empty for a new or lost session): what the next turn's plan starts from, for a caller that
        needs to know which of those tokens the model will still see (``plan_turn``)."""
        check_session_id(session_id)
        with self._lock:
            saving = self._saving.get(session_id)
        if saving is not None:
            saving.result()
        with self._lock:
            rec = self._records.get(session_id)
            return (list(rec.tokens), list(rec.ranges)) if rec is not None else ([], [])

    def hint(self, queue: Sequence[str]) -> None:
        """The sessions of the jobs queued next (head first): prefetch the look-ahead window, and
        keep them out of the evictions that saves make until the next hint."""
        with self._lock:
            self._lookahead = list(queue)
            self._apply(self.placement.prefetch([s for s in queue if s in self._records]))

    def sessions(self) -> list[SessionSummary]:
        """Every stored session, most recently used first (saves still in flight are waited for,
        so a turn that just finished is listed)."""
        with self._lock:
            saving = list(self._saving.values())
        for f in saving:
            f.result()
        with self._lock:
            out = []
            for sid, rec in self._records.items():
                info = self.placement.sessions.get(sid)
                if info is None:
                    continue
                tier = self.placement.tier_of(sid)
                if tier == "disk" and not self._kv_file_present(rec):  # its tokens only: the next turn recomputes
                    out.append(SessionSummary(sid, len(rec.tokens), 0, 0, None, rec.created, info.last_access))
                    continue
                out.append(SessionSummary(sid, len(rec.tokens), rec.num_rows, rec.nbytes, tier, rec.created,
                                          info.last_access))
        return sorted(out, key=lambda s: s.last_access, reverse=True)

    def _kv_file_present(self, rec: SessionRecord) -> bool:
        """Whether the disk tier still has the record's KV file (removed by hand, or lost with its
        disk, the record alone remains until the session's next turn finds out)."""
        path = self.disk.path_of(rec.key) if self.disk is not None else None
        return path is not None and path.exists()

    def delete(self, session_id: str) -> bool:
        """Drop a session's KV from every tier (its files too); False if there was none and no turn
        of it runs. A turn of it still running (or waiting for its closing step) is not saved when it
        finishes, and a later turn of the same id starts a new conversation."""
        self._settle_save(session_id)
        with self._lock:
            running = [t for t in self._turns.values() if t.session_id == session_id and not t.deleted]
            for t in running:
                t.deleted = True
            if session_id not in self._records:
                return bool(running)
            self._forget(session_id, "was deleted")
            self._gone.pop(session_id)  # deleted on purpose: nothing to explain to its next turn
        return True

    def drop(self, session_id: str, why: str) -> None:
        """Forget a session (e.g. its KV failed a checksum): the next turn recomputes."""
        with self._lock:
            self._forget(session_id, why)

    def _forget(self, session_id: str, why: str) -> None:
        rec = self._records.pop(session_id, None)
        self.placement.forget(session_id)
        self._memory.pop(session_id, None)
        self._note_gone(session_id, why)
        log.info("session %s %s: its next turn recomputes the history", session_id, why)
        if rec is not None:
            self._io_submit(session_id, lambda: self._delete_files(rec))

    def _note_gone(self, session_id: str, why: str) -> None:
        """Keep why the session is gone for its next turn, for the ``GONE_REASONS_KEPT`` sessions
        forgotten last (called under the lock, or before the store is shared)."""
        self._gone.pop(session_id, None)  # re-inserted last: dicts keep insertion order
        self._gone[session_id] = why
        while len(self._gone) > GONE_REASONS_KEPT:
            del self._gone[next(iter(self._gone))]

    # ---- housekeeping --------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every save and disk move queued so far."""
        with self._lock:
            saving = list(self._saving.values())
        for f in saving:
            f.result()
        with self._lock:
            io = list(self._io_pending.values())
        for f in io:
            f.result()

    def tier_of(self, session_id: str) -> str | None:
        with self._lock:
            return self.placement.tier_of(session_id)

    def stats(self) -> dict[str, float]:
        with self._lock:
            s = self.placement.stats
            return {**asdict(s), "hit_rate": s.hit_rate, "sessions": len(self._records),
                    "cpu_bytes": self.placement.used("cpu"), "disk_bytes": self.placement.used("disk")}

    def close(self) -> None:
        self.flush()
        self._saver.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        if self._folder is not None:
            self._folder.release()


def hold_sessions(root: Path) -> FolderLock:
    """The session folder ``root`` held by this process alone: every process works from its own
    memory of the sessions, so two saving into one folder lost turns (the one saved last won), and a
    session deleted beside the process serving it came back with its next turn."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _read_only_sessions(root) from exc
        raise KVStoreError(f"cannot create the sessions folder {root}: {exc.strerror}") from exc
    lock = FolderLock(
        root / "sessions.lock", exclusive=True,
        busy=f"the sessions under {root} are in use by another process (pid {{pid}}: a server, or an ask or "
             "generate with --session): one process at a time keeps a folder's sessions. Send the turn to that "
             "process (a server's /v1/rag/query, /v1/chat/completions or DELETE /v1/sessions/ID), wait for it to "
             "end, or give this one a sessions folder of its own (serve --sessions-dir, generate --session-dir)")
    if not lock.writable:  # a read-only store's: each turn's save would fail after its answer
        lock.release()
        raise _read_only_sessions(root)
    return lock


def _read_only_sessions(root: Path) -> KVStoreError:
    return KVStoreError(f"the sessions folder {root} is read-only (a read-only store, or a folder this user cannot "
                        "write): sessions need a writable one (serve --sessions-dir DIR, generate --session-dir DIR; "
                        "ask --session keeps them in the store, so it cannot run on a read-only one)")
