"""What every KV tier offers, so the tiered store can move entries between them uniformly."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

from .entry import StoredKV


@dataclass
class TierStats:
    """Counters a tier keeps about itself; ``bytes`` is what it holds now."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes: int = 0
    entries: int = 0
    capacity: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Tier(ABC):
    """A capacity-bounded place for entries, LRU inside.

    ``put`` returns the entries it pushed out to make room, so the tiered store can demote them to
    the next tier down instead of losing them. ``persistent`` tiers (disk, Redis) outlive the
    process; memory tiers are caches in front of them.
    """

    name: str
    persistent: bool
    capacity_bytes: int
    _stats: TierStats

    @abstractmethod
    def get(self, key: str, device: torch.device | None = None) -> StoredKV | None:
        """The entry (verified, on ``device`` when given) or None; a hit refreshes its LRU position."""

    @abstractmethod
    def put(self, entry: StoredKV, keep_evicted: bool = True) -> list[StoredKV]:
        """Store ``entry``; return the LRU entries evicted to make room (or ``[entry]`` itself when it
        is larger than the whole tier), for the next tier down. With ``keep_evicted=False`` (no tier
        below) a persistent tier need not read evicted entries back: it returns an empty list."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def stats(self) -> TierStats: ...

    def drop(self, key: str) -> None:
        """Forget a corrupt entry: counted, removed, and reported to the caller as a miss."""
        self._stats.corrupt += 1
        self._stats.misses += 1
        self.delete(key)

    def drop_cache(self, key: str) -> None:  # noqa: B027 - only tiers behind an OS page cache need it
        """Make the next read of ``key`` pay the tier's real cost (the disk tier drops page cache)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release files or connections."""
