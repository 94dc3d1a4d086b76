"""Where each session's KV lives (host memory, disk, or nowhere), and what moves when.

This is pure bookkeeping: it decides and returns moves, and the caller carries them out. The real
``SessionStore`` executes them on pinned memory and files; the replay benchmark executes them on
byte counts only. Both therefore run the very same policy code.

A session is one unit of placement (its KV is used whole or not at all). The hierarchy is
inclusive: every saved session is written through to disk (it must survive the process), and host
memory caches a subset. Evicting from host memory therefore only drops the cached copy, unless the
disk write has not happened (then it is a demotion); evicting from disk forgets the session.

Policies (AttentionStore, section 3.3):
- ``lru`` / ``fifo``: history only (last access / first save);
- ``scheduler``: the engine's waiting queue is a look-ahead of future accesses. Sessions queued
  within the eviction window (``(C_mem + C_disk) / mean session size`` jobs) are evicted last, and
  among them the one queued furthest back goes first. The first ``C_mem / mean session size``
  queued jobs form the prefetch window: their sessions are fetched from disk to memory before they
  run. TTL (time since last access) applies to every policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

TIERS = ("cpu", "disk")


@dataclass
class SessionInfo:
    session_id: str
    nbytes: int
    created: float
    last_access: float
    in_cpu: bool = False
    on_disk: bool = False


@dataclass(frozen=True)
class Move:
    """``uncache``: drop the memory copy (disk has one); ``persist``: write the memory copy to
    disk; ``unpersist``: delete the disk copy (memory keeps one); ``fetch``: read disk into memory;
    ``forget``: remove it everywhere (evicted from its last tier, superseded, or expired)."""

    action: str
    session_id: str


@dataclass
class PlacementStats:
    hits_cpu: int = 0
    hits_disk: int = 0
    misses: int = 0
    prefetches: int = 0
    evictions_cpu: int = 0
    evictions_disk: int = 0
    expired: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits_cpu + self.hits_disk + self.misses
        return (self.hits_cpu + self.hits_disk) / n if n else 0.0


class EvictionPolicy(ABC):
    name: str
    prefetches = False  # whether queued sessions are fetched from disk ahead of their turn

    @abstractmethod
    def order(self, held: list[SessionInfo], queue: Sequence[str], window: int) -> list[SessionInfo]:
        """``held`` in eviction order (first leaves first); ``queue`` is the waiting sessions, head
        first, and ``window`` how many of them the policy may look at."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def order(self, held: list[SessionInfo], queue: Sequence[str], window: int) -> list[SessionInfo]:
        return sorted(held, key=lambda s: s.last_access)


class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def order(self, held: list[SessionInfo], queue: Sequence[str], window: int) -> list[SessionInfo]:
        return sorted(held, key=lambda s: s.created)


class SchedulerAwarePolicy(EvictionPolicy):
    """Sessions outside the look-ahead window leave first (least recently used first); then those
    inside it, from the window's tail (needed last) to its head (needed next)."""

    name = "scheduler"
    prefetches = True

    def order(self, held: list[SessionInfo], queue: Sequence[str], window: int) -> list[SessionInfo]:
        first_pos: dict[str, int] = {}
        for i, sid in enumerate(queue[:window]):
            first_pos.setdefault(sid, i)
        outside = sorted((s for s in held if s.session_id not in first_pos), key=lambda s: s.last_access)
        inside = sorted((s for s in held if s.session_id in first_pos), key=lambda s: -first_pos[s.session_id])
        return outside + inside


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (SchedulerAwarePolicy, LRUPolicy, FIFOPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown session policy {name!r} ({', '.join(POLICIES)})")
    return POLICIES[name]()


@dataclass
class SessionPlacement:
    cpu_bytes: int
    disk_bytes: int
    policy: EvictionPolicy
    ttl_s: float | None = None
    sessions: dict[str, SessionInfo] = field(default_factory=dict)
    stats: PlacementStats = field(default_factory=PlacementStats)
    pinned: set[str] = field(default_factory=set)  # in use right now (being loaded or served)

    # ---- sizes and windows ---------------------------------------------------------------------

    def used(self, tier: str) -> int:
        attr = "in_cpu" if tier == "cpu" else "on_disk"
        return sum(s.nbytes for s in self.sessions.values() if getattr(s, attr))

    def mean_bytes(self) -> float:
        return sum(s.nbytes for s in self.sessions.values()) / len(self.sessions) if self.sessions else 0.0

    def prefetch_window(self) -> int:
        """Queued jobs whose sessions host memory can take: memory not held by sessions in use,
        divided by the mean session size (``L_pw = C_mem / S_kv``)."""
        mean = self.mean_bytes()
        if not self.policy.prefetches or mean <= 0:
            return 0
        in_use = sum(self.sessions[s].nbytes for s in self.pinned if s in self.sessions)
        return int(max(0, self.cpu_bytes - in_use) // mean)

    def eviction_window(self) -> int:
        """``(C_mem + C_disk) / S_kv`` queued jobs: what the whole hierarchy could hold."""
        mean = self.mean_bytes()
        return int((self.cpu_bytes + self.disk_bytes) // mean) if mean > 0 else 0

    def tier_of(self, session_id: str) -> str | None:
        s = self.sessions.get(session_id)
        if s is None:
            return None
        return "cpu" if s.in_cpu else "disk" if s.on_disk else None

    # ---- events --------------------------------------------------------------------------------

    def access(self, session_id: str, now: float) -> str | None:
        """A job of ``session_id`` starts: count the hit (and its tier) or the miss."""
        tier = self.tier_of(session_id)
        if tier is None:
            self.stats.misses += 1
            return None
        self.stats.hits_cpu += tier == "cpu"
        self.stats.hits_disk += tier == "disk"
        self.sessions[session_id].last_access = now
        return tier

    def admit(self, session_id: str, nbytes: int, now: float, queue: Sequence[str] = ()) -> list[Move]:
        """The session's new KV (history plus this turn) arrives in memory, replacing any older copy;
        it is written through to disk. Returns the moves, in the order to carry them out."""
        old = self.sessions.pop(session_id, None)  # the new KV supersedes the old copies (caller drops them)
        info = SessionInfo(session_id, nbytes, old.created if old else now, now)
        moves: list[Move] = []
        self.sessions[session_id] = info
        # sessions whose jobs come next and fit in memory: a session not among them is not kept in
        # memory at their expense (it goes to disk only), as prefetching would only fetch them back
        soon = set(queue[: self.prefetch_window()]) - {session_id}
        if nbytes <= self.cpu_bytes:
            room = (self._make_room("cpu", nbytes, queue, keep={session_id}) if not soon or session_id in queue
                    else self._make_room("cpu", nbytes, queue, keep=soon | {session_id}, strict=True))
            if room is not None:
                moves += room
                info.in_cpu = True
        if nbytes <= self.disk_bytes:
            moves += self._make_room("disk", nbytes, queue, keep={session_id})
            info.on_disk = True
            moves.append(Move("persist", session_id))
        if not (info.in_cpu or info.on_disk):
            del self.sessions[session_id]
            moves.append(Move("forget", session_id))
        return moves

    def prefetch(self, queue: Sequence[str]) -> list[Move]:
        """Fetch the sessions of the jobs in the prefetch window from disk into memory."""
        window = self.prefetch_window()
        moves: list[Move] = []
        for sid in dict.fromkeys(queue[:window]):
            s = self.sessions.get(sid)
            if s is None or s.in_cpu or not s.on_disk or s.nbytes > self.cpu_bytes:
                continue
            room = self._make_room("cpu", s.nbytes, queue, keep=set(queue[:window]) | {sid}, strict=True)
            if room is None:
                break  # memory is full of sessions needed sooner
            moves += room
            s.in_cpu = True
            self.stats.prefetches += 1
            moves.append(Move("fetch", sid))
        return moves

    def expire(self, now: float) -> list[Move]:
        """Forget sessions idle for longer than the TTL."""
        if self.ttl_s is None:
            return []
        gone = [sid for sid, s in self.sessions.items() if now - s.last_access > self.ttl_s and sid not in self.pinned]
        for sid in gone:
            del self.sessions[sid]
        self.stats.expired += len(gone)
        return [Move("forget", sid) for sid in gone]

    def forget(self, session_id: str) -> None:
        """The session is gone (corrupt file, deleted by the user)."""
        self.sessions.pop(session_id, None)

    def disk_write_failed(self, session_id: str) -> bool:
        """The session's disk copy could not be written, so it is not on disk; True while host
        memory still holds it (then it lives on there, without its durable copy)."""
        info = self.sessions.get(session_id)
        if info is None:
            return False
        info.on_disk = False
        return info.in_cpu

    # ---- eviction ------------------------------------------------------------------------------

    def _make_room(
        self, tier: str, nbytes: int, queue: Sequence[str], keep: set[str], strict: bool = False
    ) -> list[Move] | None:
        """Evict from ``tier`` until ``nbytes`` fit. With ``strict``, sessions in ``keep`` are never
        evicted and None says there is not enough room; otherwise ``keep`` only protects the
        session being admitted."""
        cap = self.cpu_bytes if tier == "cpu" else self.disk_bytes
        attr = "in_cpu" if tier == "cpu" else "on_disk"
        used = self.used(tier)
        if used + nbytes <= cap:
            return []
        window = self.eviction_window()
        held = [s for s in self.sessions.values()
                if getattr(s, attr) and s.session_id not in keep and s.session_id not in self.pinned]
        order = self.policy.order(held, queue, window)
        if strict:
            need = used + nbytes - cap
            if sum(s.nbytes for s in order) < need:
                return None
        moves: list[Move] = []
        for victim in order:
            if used + nbytes <= cap:
                break
            used -= victim.nbytes
            setattr(victim, attr, False)
            if tier == "cpu":
                self.stats.evictions_cpu += 1
            else:
                self.stats.evictions_disk += 1
            if not (victim.in_cpu or victim.on_disk):
                del self.sessions[victim.session_id]
                moves.append(Move("forget", victim.session_id))
            else:
                moves.append(Move("uncache" if tier == "cpu" else "unpersist", victim.session_id))
        return moves
