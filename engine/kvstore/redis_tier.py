"""The remote tier: entries in a Redis server, shared by every process that points at it.

Each entry is one Redis hash: field ``meta`` (the entry's JSON metadata, checksums included) and one
field per layer, so a reader can fetch a single layer with HGET. A sorted set orders entries by last
access (the LRU); a counter holds the bytes stored. Several processes share one server, so the counter
moves only inside Lua scripts that Redis runs atomically: a put counts an entry's bytes only if it
created the hash, a removal gives them back only if it deleted it. Two processes putting, deleting or
evicting the same entry at once thus count it once, and the counter stays the sum of the entries held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .entry import CorruptEntryError, EntryMeta, KVStoreError, StoredKV, tensor_bytes
from .tier import Tier, TierStats

# KEYS: entry hash, LRU, byte counter. ARGV: entry key, access time, nbytes, then field, value, ...
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[3])
return 1
"""

# KEYS: entry hash, LRU, byte counter. ARGV: entry key.
_REMOVE = """
local nbytes = redis.call('HGET', KEYS[1], 'nbytes')
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
if nbytes then redis.call('DECRBY', KEYS[3], nbytes) end
return 1
"""


class RedisTier(Tier):
    persistent = True

    def __init__(self, url: str, capacity_bytes: int, prefix: str = "ragfuse:kv", name: str = "redis") -> None:
        try:
            import redis
        except ImportError as exc:
            raise KVStoreError("the Redis tier needs the `redis` package: pip install 'ragfuse[rag]'") from exc
        self.name = name
        self.url = url
        self.capacity_bytes = int(capacity_bytes)
        self.prefix = prefix
        self._redis_errors = (redis.RedisError, OSError)
        self._r = redis.Redis.from_url(url, socket_timeout=30)
        try:
            self._r.ping()
        except self._redis_errors as exc:
            raise KVStoreError(f"Redis at {url} is not reachable: {exc}") from exc
        self._create_script = self._r.register_script(_CREATE)
        self._remove_script = self._r.register_script(_REMOVE)
        self._stats = TierStats(capacity=self.capacity_bytes)

    @contextmanager
    def _talking(self) -> Iterator[None]:
        """Client and socket errors as ``KVStoreError``: what callers of any tier catch."""
        try:
            yield
        except self._redis_errors as exc:
            raise KVStoreError(f"Redis at {self.url} failed: {exc}") from exc

    def _hkey(self, key: str) -> str:
        return f"{self.prefix}:e:{key}"

    @property
    def _lru(self) -> str:
        return f"{self.prefix}:lru"

    @property
    def _bytes(self) -> str:
        return f"{self.prefix}:bytes"

    def meta(self, key: str) -> EntryMeta | None:
        """The entry's metadata (shape, checksums) without its layers; pair with ``read_layer``."""
        with self._talking():
            raw = self._r.hget(self._hkey(key), "meta")
        if raw is None:
            return None
        return EntryMeta.from_json(json.loads(raw))

    def read_layer(self, key: str, meta: EntryMeta, i: int) -> torch.Tensor:
        """Layer ``i`` of ``key`` on CPU, verified (the per-layer access the fusor uses)."""
        with self._talking():
            raw = self._r.hget(self._hkey(key), f"L{i:04d}")
        if raw is None:
            raise CorruptEntryError(f"entry {key}: layer {i} missing in Redis")
        return _verified_layer(meta, i, raw)

    def get(self, key: str, device: torch.device | None = None) -> StoredKV | None:
        with self._talking():
            fields = self._r.hgetall(self._hkey(key))
        if not fields:
            self._stats.misses += 1
            return None
        try:
            meta = EntryMeta.from_json(json.loads(fields[b"meta"]))
            layers = [_verified_layer(meta, i, fields.get(f"L{i:04d}".encode())) for i in range(meta.num_layers)]
        except (CorruptEntryError, KeyError, ValueError):
            self._stats.corrupt += 1
            self._stats.misses += 1
            self.delete(key)
            return None
        self._stats.hits += 1
        with self._talking():
            self._r.zadd(self._lru, {key: time.time()}, xx=True)  # xx: never revive one removed meanwhile
        entry = StoredKV(meta, layers)
        return entry if device is None or torch.device(device).type == "cpu" else entry.to(device)

    def put(self, entry: StoredKV, keep_evicted: bool = True) -> list[StoredKV]:
        size = entry.nbytes
        if size > self.capacity_bytes:
            return [entry]
        with self._talking():
            if self._r.exists(self._hkey(entry.key)):  # saves the upload; _CREATE decides, atomically
                return []
            evicted: list[StoredKV] = []
            while int(self._r.get(self._bytes) or 0) + size > self.capacity_bytes:
                popped = self._r.zpopmin(self._lru)
                if not popped:
                    break
                old_key = popped[0][0].decode()
                old = self.get(old_key) if keep_evicted else None
                self._stats.hits -= old is not None  # reading for demotion is not a hit
                self._remove(old_key)
                self._stats.evictions += 1
                if old is not None:
                    evicted.append(old)
            fields: list[str | bytes] = ["meta", json.dumps(entry.meta.to_json()), "nbytes", str(size)]
            for i, t in enumerate(entry.layers):
                fields += [f"L{i:04d}", bytes(tensor_bytes(t.to("cpu")))]
            self._create_script(keys=[self._hkey(entry.key), self._lru, self._bytes],
                                args=[entry.key, time.time(), size, *fields])
        return evicted

    def _remove(self, key: str) -> bool:
        """Delete the entry and give back its bytes, only if this call deleted it (two processes may race here)."""
        return bool(self._remove_script(keys=[self._hkey(key), self._lru, self._bytes], args=[key]))

    def contains(self, key: str) -> bool:
        with self._talking():
            return bool(self._r.exists(self._hkey(key)))

    def delete(self, key: str) -> bool:
        with self._talking():
            return self._remove(key)

    def stats(self) -> TierStats:
        with self._talking():
            self._stats.bytes = int(self._r.get(self._bytes) or 0)
            self._stats.entries = int(self._r.zcard(self._lru))
        return self._stats

    def close(self) -> None:
        self._r.close()


def _verified_layer(meta: EntryMeta, i: int, raw: bytes | None) -> torch.Tensor:
    if raw is None or len(raw) != meta.layer_nbytes:
        raise CorruptEntryError(f"entry {meta.key}: layer {i} has the wrong size")
    layer = torch.frombuffer(bytearray(raw), dtype=meta.dtype).view(meta.layer_shape)
    meta.verify_layer(i, layer)
    return layer
