"""Stored per-chunk KV: a tiered store (GPU, CPU, disk, Redis) and the CacheBlend loading controller.

The fusor fetches entries through ``TieredKVStore.get`` (or a tier's layer-by-layer reader) and asks
the ``LoadingController`` how much to recompute given where the entry was found.
"""

from .controller import LoadingController, LoadingDecision, TierEstimate
from .disk import DiskEntryReader, DiskFullError, DiskTier
from .entry import CorruptEntryError, EntryMeta, KVShape, KVStoreError, StoredKV, UnreadableEntryError, kv_key
from .memory import MemoryTier
from .profile import DelayProfile, measure_prefill, measure_read_bandwidth, profile_path
from .redis_tier import RedisTier, check_redis
from .source import EntrySource, LayerwiseSource, open_source
from .store import TieredKVStore
from .tier import Tier, TierStats

__all__ = [
    "CorruptEntryError", "DelayProfile", "EntrySource", "LayerwiseSource", "open_source",
    "DiskEntryReader", "DiskFullError", "DiskTier", "EntryMeta", "KVShape", "KVStoreError",
    "LoadingController", "LoadingDecision", "MemoryTier", "RedisTier", "StoredKV", "check_redis", "Tier",
    "TierEstimate", "TierStats",
    "TieredKVStore", "UnreadableEntryError", "kv_key", "measure_prefill", "measure_read_bandwidth", "profile_path",
]
