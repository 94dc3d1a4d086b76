"""Delay profiles: measured prefill time and per-tier read bandwidth for one (model, device, dtype).

The loading controller decides from these numbers, not from constants: a profile is measured once
(``ragfuse profile``) and cached as JSON next to the store, keyed by model fingerprint and device.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic_file import write_atomic
from .entry import KVStoreError, StoredKV
from .tier import Tier


@dataclass
class DelayProfile:
    model: str
    device: str
    dtype: str
    kv_bytes_per_token: int
    prefill_points: list[tuple[int, float]]  # (tokens, seconds of a full prefill), increasing tokens
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier name -> bytes/s into `device`
    measured_at: str = ""

    def prefill_s(self, num_tokens: int) -> float:
        """Full-prefill time of ``num_tokens``: piecewise linear through (0, 0) and the measured
        points, extended past the last point with the last segment's per-token slope (attention
        makes the curve slightly convex, so measure near the lengths you serve)."""
        if not self.prefill_points:
            raise KVStoreError("the delay profile holds no prefill measurement")
        pts = [(0, 0.0), *sorted(self.prefill_points)]
        xs = [p[0] for p in pts]
        j = min(max(bisect.bisect_left(xs, num_tokens), 1), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[j - 1], pts[j]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def prefill_s_per_token(self, num_tokens: int) -> float:
        return self.prefill_s(num_tokens) / max(num_tokens, 1)

    def load_s(self, num_tokens: int, tier: str) -> float:
        if tier not in self.bandwidth:
            raise KVStoreError(f"no bandwidth measured for tier {tier!r} (profiled: {', '.join(self.bandwidth)})")
        return self.kv_bytes_per_token * num_tokens / self.bandwidth[tier]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> DelayProfile:
        try:
            d = json.loads(Path(path).read_text())
            d["prefill_points"] = [tuple(p) for p in d["prefill_points"]]
            return cls(**d)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise KVStoreError(f"cannot read delay profile {path}: {exc}") from exc


def profile_path(cache_dir: str | Path, model: str, device: str, dtype: str) -> Path:
    tag = hashlib.blake2b(f"{model}|{device}|{dtype}".encode(), digest_size=8).hexdigest()
    return Path(cache_dir) / f"profile-{tag}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_prefill(
    compute_kv: Callable[[list[list[int]]], object], lengths: Sequence[int], vocab_size: int,
    device: torch.device, repeats: int = 2,
) -> list[tuple[int, float]]:
    """Median wall time of a full prefill (KV capture) of random tokens at each length."""
    gen = torch.Generator().manual_seed(0)
    compute_kv([torch.randint(0, vocab_size, (min(lengths),), generator=gen).tolist()])  # warm-up
    points = []
    for n in sorted(lengths):
        times = []
        for _ in range(repeats):
            toks = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
            _sync(device)
            t0 = time.perf_counter()
            compute_kv([toks])
            _sync(device)
            times.append(time.perf_counter() - t0)
        points.append((n, statistics.median(times)))
    return points


def synthetic_entry(key: str, num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> StoredKV:
    """An entry of a model's real shape filled with random values (bandwidth does not depend on them)."""
    k = torch.randn(num_layers, num_tokens, num_kv_heads, head_dim).to(dtype)
    return StoredKV.from_kv(key, k, torch.randn_like(k, dtype=torch.float32).to(dtype))


def measure_read_bandwidth(tier: Tier, entries: Sequence[StoredKV], device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of reading ``entries`` from ``tier`` into ``device`` memory (page cache dropped
    before every read, so the disk is really read). The entries are stored first and deleted after."""
    for e in entries:
        tier.put(e, keep_evicted=False)
    try:
        times = []
        for _ in range(repeats):
            for e in entries:
                tier.drop_cache(e.key)
            _sync(device)
            t0 = time.perf_counter()
            for e in entries:
                if tier.get(e.key, device) is None:
                    raise KVStoreError(f"tier {tier.name!r} lost an entry while being profiled (capacity too small?)")
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        for e in entries:
            tier.delete(e.key)
    return sum(e.nbytes for e in entries) / statistics.median(times)
