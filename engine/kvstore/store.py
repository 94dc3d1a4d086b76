"""The tiered KV store: an ordered list of tiers, fastest first, with promotion and demotion.

Policy:
- ``get`` looks in each tier from the top; a hit below the top is promoted to the top tier (memory
  tiers hand the entry over, persistent tiers keep their copy, since keeping it costs nothing and
  saves rewriting it when it is demoted again);
- what a tier pushes out (LRU) goes to the next tier down; out of the last tier it is gone. An entry
  a tier refuses (a full disk, a value Redis will not take) goes on down too; refused by the last
  tier, a pushed-out entry is gone with a warning, and only the caller's own entry fails its ``put``;
- ``put`` places new entries in the top tier and writes them through to the first persistent tier
  (if any), so a precomputed entry survives the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .entry import KVStoreError, StoredKV, kv_key
from .tier import Tier, TierStats

log = logging.getLogger("ragfuse.kvstore")


class TieredKVStore:
    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def locate(self, key: str) -> str | None:
        """Name of the fastest tier holding ``key`` (no stats change, no promotion)."""
        return next((t.name for t in self.tiers if t.contains(key)), None)

    def persist(self, key: str) -> bool:
        """Whether a persistent tier holds ``key`` once this returns: an entry only a memory tier
        holds (a server's hot chunk whose disk copy was removed) is written through from there, so
        whoever counts it stored finds it after a restart, in another process, or once evicted."""
        persistent = [i for i, t in enumerate(self.tiers) if t.persistent]
        if any(self.tiers[i].contains(key) for i in persistent):
            return True
        if not persistent:
            return any(t.contains(key) for t in self.tiers)
        for tier in self.tiers[: persistent[0]]:
            entry = tier.get(key)
            if entry is not None:
                self._insert(persistent[0], entry)
                return True
        return False

    def get(self, key: str, device: torch.device | str | None = None) -> StoredKV | None:
        """The entry from the fastest tier that holds it (verified), promoted to the top; or None."""
        for i, tier in enumerate(self.tiers):
            entry = tier.get(key, device)
            if entry is None:
                continue
            if i > 0:
                if not tier.persistent:
                    tier.delete(key)
                self._insert(0, entry)
            return entry
        return None

    def put(self, entry: StoredKV) -> None:
        self._insert(0, entry)
        persistent = next((i for i, t in enumerate(self.tiers) if t.persistent), None)
        if persistent not in (None, 0):
            self._insert(persistent, entry)

    def put_top(self, entry: StoredKV) -> None:
        """Promote an entry read from a lower tier into the top tier (no write-through: it is
        already persisted where it came from)."""
        self._insert(0, entry)

    def _insert(self, level: int, entry: StoredKV) -> None:
        """Put ``entry`` in tier ``level``; cascade what falls out down the tiers. An entry a tier
        refuses goes on down as well; raises (once the rest is placed) when ``entry`` itself was
        refused down to the last tier: the first refusal, where it was meant to go."""
        pending = [(level, entry)]
        failed: KVStoreError | OSError | None = None
        while pending:
            lvl, e = pending.pop()
            last = lvl == len(self.tiers) - 1
            try:
                out = self.tiers[lvl].put(e, keep_evicted=not last)
            except (KVStoreError, OSError) as exc:
                if e is entry:
                    failed = failed or exc
                if not last:
                    pending.append((lvl + 1, e))
                elif e is not entry:
                    log.warning("KV entry %s, pushed out of the tiers above, is lost: tier %s refused it (%s)",
                                e.key, self.tiers[lvl].name, exc)
                continue
            if e is entry:
                failed = None
            if not last:
                pending.extend((lvl + 1, x) for x in out)
        if failed is not None:
            raise failed

    def get_or_compute(
        self, fingerprint: str, dtype: torch.dtype, token_lists: Sequence[Sequence[int]],
        compute: Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]],
        device: torch.device | str | None = None,
    ) -> list[StoredKV]:
        """Each token list's entry: served when stored (and intact), else computed in one batch by
        ``compute`` (e.g. ``LLMEngine.compute_kv``), stored, and returned."""
        keys = [kv_key(fingerprint, dtype, toks) for toks in token_lists]
        found = {k: e for k in dict.fromkeys(keys) if (e := self.get(k, device)) is not None}
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        if missing:
            todo = [list(token_lists[keys.index(k)]) for k in missing]
            for k, (kk, vv) in zip(missing, compute(todo)):
                entry = StoredKV.from_kv(k, kk, vv)
                self.put(entry)
                found[k] = entry if device is None else entry.to(device)
        return [found[k] for k in keys]

    def delete(self, key: str) -> bool:
        return any([t.delete(key) for t in self.tiers])

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}

    def close(self) -> None:
        for t in self.tiers:
            t.close()
