"""The remote tier: entries in a Redis server, shared by every process that points at it.

Each entry is one Redis hash: field ``meta`` (the entry's JSON metadata, checksums included) and one
field per layer, so a reader can fetch a single layer with HGET. A sorted set orders entries by last
access (the LRU); a counter holds the bytes stored. Several processes share one server, so the counter
moves only inside Lua scripts that Redis runs atomically: a put checks the room, evicts and creates the
entry in one script (counting its bytes only if it created the hash), a removal gives them back only if
it deleted it. Two processes putting, deleting or evicting at once thus count each entry once, the
counter stays the sum of the entries held, and two puts cannot both take the last room.

An evicted entry the tier below should get is renamed aside inside the put's script (O(1), the server
is not held while it is copied), read back by the putting process, then deleted; one left aside by a
process that died expires by itself.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .entry import CorruptEntryError, EntryMeta, KVStoreError, StoredKV, tensor_bytes
from .tier import Tier, TierStats

# KEYS: entry hash, LRU, byte counter. ARGV: entry key, access time, nbytes, capacity, entry hash prefix,
# prefix evicted entries are renamed to ('': delete them), its expiry in seconds, then field, value, ...
# Returns {created (0 or 1), evicted key, ...}.
_PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local size = tonumber(ARGV[3])
local out = {1}
while tonumber(redis.call('GET', KEYS[3]) or '0') + size > tonumber(ARGV[4]) do
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 then break end
  local old = ARGV[5] .. popped[1]
  local nbytes = redis.call('HGET', old, 'nbytes')
  if nbytes then
    redis.call('DECRBY', KEYS[3], nbytes)
    if ARGV[6] == '' then
      redis.call('DEL', old)
    else
      redis.call('RENAME', old, ARGV[6] .. popped[1])
      redis.call('EXPIRE', ARGV[6] .. popped[1], ARGV[7])
    end
  end
  out[#out + 1] = popped[1]
end
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('INCRBY', KEYS[3], ARGV[3])
return out
"""

# KEYS: entry hash, LRU, byte counter. ARGV: entry key.
_REMOVE = """
local nbytes = redis.call('HGET', KEYS[1], 'nbytes')
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
if nbytes then redis.call('DECRBY', KEYS[3], nbytes) end
return 1
"""

ASIDE_TTL_S = 600  # an evicted entry set aside for demotion, should its reader die before deleting it
DEFAULT_MAX_BULK = 512 << 20  # Redis's proto-max-bulk-len when the server will not say (CONFIG disabled)
_SCAN_BATCH = 1000  # entries' sizes asked in one round trip


def connect(url: str) -> Any:
    """A client of the Redis server at ``url``, which answered a ping; ``KVStoreError`` (one line,
    no traceback) for a URL Redis does not take, a server that does not answer, or no ``redis``
    package. Commands call it before they load a model: a mistyped URL is told at once."""
    try:
        import redis
    except ImportError as exc:
        raise KVStoreError("the Redis tier needs the `redis` package: pip install 'ragfuse[rag]'") from exc
    try:
        client = redis.Redis.from_url(url, socket_timeout=30)
    except ValueError as exc:  # no or an unknown scheme, a bad port or database number
        raise KVStoreError(f"bad Redis URL {url!r}: {exc}") from exc
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        client.close()
        raise KVStoreError(f"Redis at {url} is not reachable: {exc}") from exc
    return client


def check_redis(url: str | None) -> None:
    """Refuse a Redis URL that ``connect`` refuses (None: no Redis asked for)."""
    if url is not None:
        connect(url).close()


class RedisTier(Tier):
    persistent = True

    def __init__(self, url: str, capacity_bytes: int, prefix: str = "ragfuse:kv", name: str = "redis") -> None:
        self._r = connect(url)
        import redis  # there: ``connect`` said so otherwise

        self.name = name
        self.url = url
        self.capacity_bytes = int(capacity_bytes)
        self.prefix = prefix
        self._redis_errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError
        self._put_script = self._r.register_script(_PUT)
        self._remove_script = self._r.register_script(_REMOVE)
        self._stats = TierStats(capacity=self.capacity_bytes)
        self._max_bulk: int | None = None  # the server's proto-max-bulk-len, asked on the first put

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
        """The entry's metadata (shape, checksums) without its layers; pair with ``read_layer``.
        Metadata that does not read or verify is ``CorruptEntryError``, and the entry is dropped."""
        with self._talking():
            raw = self._r.hget(self._hkey(key), "meta")
        if raw is None:
            return None
        try:
            return _parse_meta(key, raw)
        except CorruptEntryError:
            self.drop(key)
            raise

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
            entry = _parse_entry(key, fields)
        except CorruptEntryError:
            self.drop(key)
            return None
        self._stats.hits += 1
        with self._talking():
            self._r.zadd(self._lru, {key: time.time()}, xx=True)  # xx: never revive one removed meanwhile
        return entry if device is None or torch.device(device).type == "cpu" else entry.to(device)

    def put(self, entry: StoredKV, keep_evicted: bool = True) -> list[StoredKV]:
        """Room check, eviction and creation run as one script (``_PUT``). An entry with a value the
        server would refuse is a ``KVStoreError`` before anything is evicted."""
        size = entry.nbytes
        if size > self.capacity_bytes:
            return [entry]
        meta = json.dumps(entry.meta.to_json())
        with self._talking():
            biggest, limit = max(entry.meta.layer_nbytes, len(meta)), self._bulk_limit()
            if biggest > limit:
                raise KVStoreError(
                    f"KV entry {entry.key} has a value of {biggest / 2**20:.1f} MiB, more than the Redis server "
                    f"at {self.url} takes (proto-max-bulk-len {limit / 2**20:.1f} MiB): raise it there or keep "
                    "such entries on disk"
                )
            if self._r.exists(self._hkey(entry.key)):  # saves the upload; _PUT decides, atomically
                return []
            fields: list[str | bytes] = ["meta", meta, "nbytes", str(size)]
            for i, t in enumerate(entry.layers):
                fields += [f"L{i:04d}", bytes(tensor_bytes(t.to("cpu")))]
            aside = f"{self.prefix}:aside:{uuid.uuid4().hex}:" if keep_evicted else ""
            _created, *gone = self._put_script(
                keys=[self._hkey(entry.key), self._lru, self._bytes],
                args=[entry.key, time.time(), size, self.capacity_bytes, self._hkey(""), aside, ASIDE_TTL_S, *fields],
            )
            self._stats.evictions += len(gone)
            evicted = [e for k in gone if aside and (e := self._take_aside(aside, k.decode())) is not None]
        return evicted

    def _bulk_limit(self) -> int:
        """The largest value the server takes (``proto-max-bulk-len``), asked once: a larger one
        fails the command mid-upload and drops the connection."""
        if self._max_bulk is None:
            try:
                self._max_bulk = int(self._r.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
            except (self._refused, KeyError, ValueError):  # CONFIG renamed or disabled (managed servers)
                self._max_bulk = DEFAULT_MAX_BULK
        return self._max_bulk

    def _take_aside(self, aside: str, key: str) -> StoredKV | None:
        """An entry the put's script evicted and set aside: read, deleted, and returned for the tier
        below (None where it does not verify, counted as corrupt)."""
        with self._r.pipeline() as pipe:
            fields, _ = pipe.hgetall(aside + key).delete(aside + key).execute()
        try:
            return _parse_entry(key, fields) if fields else None
        except CorruptEntryError:
            self._stats.corrupt += 1
            return None

    def _remove(self, key: str) -> bool:
        """Delete the entry and give back its bytes, only if this call deleted it (two processes may race here)."""
        return bool(self._remove_script(keys=[self._hkey(key), self._lru, self._bytes], args=[key]))

    def contains(self, key: str) -> bool:
        with self._talking():
            return bool(self._r.exists(self._hkey(key)))

    def delete(self, key: str) -> bool:
        with self._talking():
            return self._remove(key)

    def entry_sizes(self) -> dict[str, int]:
        """Bytes of each entry of this tier's namespace, by key: those its LRU lists, which every put
        adds to and every removal takes from in the same script (entries set aside for demotion are
        no longer listed and expire by themselves). Other namespaces on the server are never read."""
        with self._talking():
            keys = [k.decode() for k in self._r.zrange(self._lru, 0, -1)]
            sizes: dict[str, int] = {}
            for start in range(0, len(keys), _SCAN_BATCH):
                part = keys[start:start + _SCAN_BATCH]
                with self._r.pipeline(transaction=False) as pipe:
                    for key in part:
                        pipe.hget(self._hkey(key), "nbytes")
                    sizes.update((k, int(n)) for k, n in zip(part, pipe.execute()) if n is not None)
        return sizes

    def intact(self, key: str) -> bool | None:
        """Whether every layer of ``key`` matches its checksum (None: no such entry, e.g. evicted
        meanwhile). Reads it whole without counting a hit or refreshing its LRU position: a scan of the
        whole tier must not make every entry look recently used."""
        with self._talking():
            fields = self._r.hgetall(self._hkey(key))
        if not fields:
            return None
        try:
            _parse_entry(key, fields)
        except CorruptEntryError:
            return False
        return True

    def stats(self) -> TierStats:
        with self._talking():
            self._stats.bytes = int(self._r.get(self._bytes) or 0)
            self._stats.entries = int(self._r.zcard(self._lru))
        return self._stats

    def close(self) -> None:
        self._r.close()


def _parse_meta(key: str, raw: bytes) -> EntryMeta:
    """An entry's ``meta`` field, verified (``EntryMeta.from_json``) and checked to be ``key``'s."""
    try:
        meta = EntryMeta.from_json(json.loads(raw))
    except ValueError as exc:  # not JSON, or not UTF-8 (a flipped byte)
        raise CorruptEntryError(f"entry {key}: metadata unreadable ({exc})") from exc
    if meta.key != key:
        raise CorruptEntryError(f"entry {key}: metadata names entry {meta.key}")
    return meta


def _parse_entry(key: str, fields: dict[bytes, bytes]) -> StoredKV:
    """An entry from its hash's fields, every layer verified."""
    if b"meta" not in fields:
        raise CorruptEntryError(f"entry {key}: no metadata")
    meta = _parse_meta(key, fields[b"meta"])
    return StoredKV(meta, [_verified_layer(meta, i, fields.get(f"L{i:04d}".encode())) for i in range(meta.num_layers)])


def _verified_layer(meta: EntryMeta, i: int, raw: bytes | None) -> torch.Tensor:
    if raw is None or len(raw) != meta.layer_nbytes:
        raise CorruptEntryError(f"entry {meta.key}: layer {i} has the wrong size")
    layer = torch.frombuffer(bytearray(raw), dtype=meta.dtype).view(meta.layer_shape)
    meta.verify_layer(i, layer)
    return layer
