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
- a lookup never serves a session whose bytes fail their checksum: the entry is forgotten and the
  caller recomputes (and says so).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import RequestError
from ..kvstore import DiskTier, KVStoreError, StoredKV, kv_key
from ..kvstore.entry import EntryMeta, dtype_name, layer_checksum
from .history import Ranges
from .placement import Move, SessionInfo, SessionPlacement, make_policy
from .snapshot import Snapshot
from .source import SessionCorruptError, SessionSource, disk_source, memory_source

log = logging.getLogger("ragfuse.sessions")
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID.match(session_id or ""):
        raise RequestError(f"session id {session_id!r} must be 1-128 letters, digits or _.:@-")
    return session_id


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
    ) -> None:
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.clock = clock
        self.root = Path(root) if root is not None else None
        self.placement = SessionPlacement(cpu_bytes, disk_bytes if root is not None else 0, make_policy(policy), ttl_s)
        self.disk: DiskTier | None = None
        if self.root is not None:
            # the placement decides disk evictions; the tier's own LRU must never fire first
            self.disk = DiskTier(self.root / "kv", capacity_bytes=2 * disk_bytes + (1 << 30), name="disk",
                                 reserve_bytes=0)
            (self.root / "records").mkdir(parents=True, exist_ok=True)
        self._records: dict[str, SessionRecord] = {}
        self._memory: dict[str, StoredKV] = {}
        self._gone: dict[str, str] = {}  # why a session known earlier is not there any more
        self._lock = threading.RLock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="ragfuse-session-save")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ragfuse-session-io")
        self._saving: dict[str, Future[None]] = {}
        self._io_pending: dict[str, Future[None]] = {}
        self._load_records()

    # ---- records on disk -----------------------------------------------------------------------

    def _record_path(self, session_id: str) -> Path:
        assert self.root is not None
        return self.root / "records" / f"{session_id}.json"

    def _load_records(self) -> None:
        """Sessions saved by earlier processes: on disk, not in memory."""
        if self.root is None or self.disk is None:
            return
        for path in sorted((self.root / "records").glob("*.json")):
            try:
                rec = SessionRecord.from_json(path.read_text())
            except (ValueError, TypeError, KeyError):
                path.unlink(missing_ok=True)
                continue
            if not self.disk.contains(rec.key):
                path.unlink(missing_ok=True)
                continue
            self._records[rec.session_id] = rec
            self.placement.sessions[rec.session_id] = SessionInfo(
                rec.session_id, rec.nbytes, rec.created, path.stat().st_mtime, on_disk=True
            )

    # ---- saving --------------------------------------------------------------------------------

    def save(self, session_id: str, tokens: list[int], ranges: Ranges, snapshot: Snapshot,
             queue: Sequence[str] = ()) -> Future[None]:
        """Save a turn's KV (``snapshot``, rows for ``ranges`` of the logical ``tokens``) in the
        background; returns when the work is queued."""
        check_session_id(session_id)
        created = self._records[session_id].created if session_id in self._records else self.clock()

        def work() -> None:
            layers = snapshot.wait()
            key = kv_key(f"{self.fingerprint}\0session\0{session_id}", self.dtype, tokens)
            meta = EntryMeta(key=key, num_layers=layers.shape[0], num_tokens=layers.shape[2],
                             num_kv_heads=layers.shape[3], head_dim=layers.shape[4], dtype=layers.dtype,
                             layer_checksums=tuple(layer_checksum(t) for t in layers))
            entry = StoredKV(meta, list(layers.unbind(0)))
            rec = SessionRecord(session_id, key, list(tokens), list(ranges), meta.num_tokens, meta.nbytes, created,
                                self.fingerprint, dtype_name(self.dtype))
            with self._lock:
                moves = self.placement.admit(session_id, entry.nbytes, self.clock(), queue)
                self._apply(moves, new=(rec, entry))

        with self._lock:
            fut = self._saver.submit(work)
            self._saving[session_id] = fut
        return fut

    def _apply(self, moves: list[Move], new: tuple[SessionRecord, StoredKV] | None = None) -> None:
        """Carry out placement moves (under the lock; disk work goes to the I/O thread, in order).
        ``new``: a session just admitted, whose record and memory copy are not registered yet."""
        if new is not None:
            rec, entry = new
            old = self._records.get(rec.session_id)
            if old is not None:  # superseded by the new turn's KV
                self._memory.pop(rec.session_id, None)
                self._io_submit(rec.session_id, lambda r=old: self._delete_files(r))
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
                self._io_submit(sid, lambda r=rec, e=self._memory[sid]: self._write_files(r, e))
            elif move.action == "fetch" and rec is not None:
                self._io_submit(sid, lambda r=rec: self._fetch(r))
        if new is not None:
            info = self.placement.sessions.get(new[0].session_id)
            if info is not None and not info.in_cpu:
                self._memory.pop(new[0].session_id, None)  # written to disk only (larger than memory)

    def _io_submit(self, session_id: str, fn: Callable[[], None]) -> None:
        self._io_pending[session_id] = self._io.submit(fn)

    def _write_files(self, rec: SessionRecord, entry: StoredKV) -> None:
        """Persist a session (on the I/O thread). A disk that cannot take it (full, failing) costs
        the durable copy only, while memory holds the session, else the session itself, as an
        eviction would, with the reason; raised here, the error would resurface at every later
        lookup and at close, and the session could never be used or replaced."""
        assert self.disk is not None and self.root is not None
        tmp = self._record_path(rec.session_id).with_suffix(".tmp")
        try:
            self.disk.put(entry, keep_evicted=False)
            tmp.write_text(rec.to_json())
            os.replace(tmp, self._record_path(rec.session_id))
        except (KVStoreError, OSError) as exc:
            tmp.unlink(missing_ok=True)
            log.warning("session %s could not be written to disk: %s", rec.session_id, exc)
            with self._lock:
                if self._records.get(rec.session_id) is not rec:
                    return  # superseded by a later turn, whose own write decides
                if not (rec.session_id in self._memory and self.placement.disk_write_failed(rec.session_id)):
                    self._forget(rec.session_id, f"could not be written to disk ({exc})")

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
            rec = self._records.get(session_id)
            pending = self._io_pending.get(session_id)
        if rec is None:
            reason = self._gone.get(session_id)
            return Lookup(None, None, f"session {session_id} {reason}" if reason else "")
        if pending is not None and session_id not in self._memory:
            pending.result()
        if rec.fingerprint != self.fingerprint or rec.dtype != dtype_name(self.dtype):
            return Lookup(None, None, f"session {session_id} was saved by another model or dtype")
        with self._lock:
            tier = self.placement.access(session_id, self.clock())
            entry = self._memory.get(session_id)
        if entry is not None:
            layers = entry.layers
            return Lookup(rec, "cpu", "", lambda n, rows: memory_source(layers, n, rows, session_id))
        if tier is None or self.disk is None:
            return Lookup(None, None, f"session {session_id} is not stored")
        return Lookup(rec, "disk", "", lambda n, rows: self._open_disk(rec, n, rows))

    def _open_disk(self, rec: SessionRecord, num_tokens: int, rows: list[int] | None) -> SessionSource:
        assert self.disk is not None
        reader = self.disk.open(rec.key)
        if reader is None:
            self.drop(rec.session_id, "was not readable on disk")
            raise SessionCorruptError(rec.session_id, "was not readable on disk")
        return disk_source(reader, num_tokens, rows, rec.session_id)

    def conversation(self, session_id: str) -> list[int]:
        """The session's logical tokens so far (empty for a new or lost session), for a caller that
        appends its next turn to them."""
        check_session_id(session_id)
        with self._lock:
            saving = self._saving.get(session_id)
        if saving is not None:
            saving.result()
        with self._lock:
            rec = self._records.get(session_id)
            return list(rec.tokens) if rec is not None else []

    def hint(self, queue: Sequence[str]) -> None:
        """The engine's waiting sessions (head first): prefetch the look-ahead window."""
        with self._lock:
            self._apply(self.placement.prefetch([s for s in queue if s in self._records], self.clock()))

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
                out.append(SessionSummary(sid, len(rec.tokens), rec.num_rows, rec.nbytes,
                                          self.placement.tier_of(sid), rec.created, info.last_access))
        return sorted(out, key=lambda s: s.last_access, reverse=True)

    def delete(self, session_id: str) -> bool:
        """Drop a session's KV from every tier (its files too); False if there was none. A later
        turn of the same id starts a new conversation (a turn still running when this is called
        saves its KV as usual when it finishes)."""
        self._settle_save(session_id)
        with self._lock:
            if session_id not in self._records:
                return False
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
        self._gone[session_id] = why
        log.info("session %s %s: its next turn recomputes the history", session_id, why)
        if rec is not None:
            self._io_submit(session_id, lambda: self._delete_files(rec))

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

