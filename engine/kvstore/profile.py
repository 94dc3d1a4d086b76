"""Delay profiles: measured prefill time, fused-pass time per recompute ratio and per-tier read
bandwidth for one (model, device, dtype).

The loading controller decides from these numbers, not from constants: a profile is measured once
(``ragfuse profile``) and cached as JSON next to the store, keyed by model fingerprint and device.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
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
    # (stored tokens, ratio, compute time of a fused pass at that ratio / a full prefill's of the same
    # prompt), the same ratios from 0 to 1 at each length: a fused pass is not ratio x prefill, its check
    # layers run every token and its query and per-layer work are fixed costs (on CPU, default model, a
    # 5% pass took 21% of a full prefill's time over 768 stored tokens, 14% over 3072)
    recompute_points: list[tuple[int, float, float]]
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier name -> bytes/s into `device`
    measured_at: str = ""

    def __post_init__(self) -> None:
        """Every field of its kind, every time and rate finite and positive, and each length's curve
        spanning ratios 0 to 1 in order, the same ratios at every length (the controller interpolates
        between lengths and inverts the curve): a hand-edited or damaged profile fails here, where it
        is read, and not as a traceback or a nonsense ratio inside a request."""
        for name in ("model", "device", "dtype", "measured_at"):
            if not isinstance(getattr(self, name), str):
                raise KVStoreError(f"{name} must be a string, not {getattr(self, name)!r}")
        if not _count(self.kv_bytes_per_token):
            raise KVStoreError(f"kv_bytes_per_token must be a positive whole number, not {self.kv_bytes_per_token!r}")
        if not self.prefill_points:
            raise KVStoreError("the delay profile holds no prefill measurement")
        for point in self.prefill_points:
            if len(point) != 2 or not _count(point[0]) or not _positive(point[1]):
                raise KVStoreError(f"a prefill point must be (tokens, seconds), both positive, not {list(point)}")
        if not isinstance(self.bandwidth, dict) or not all(
                isinstance(k, str) and _positive(v) for k, v in self.bandwidth.items()):
            raise KVStoreError(f"bandwidth must map tier names to positive bytes/s, not {self.bandwidth!r}")
        for point in self.recompute_points:
            if len(point) != 3 or not _count(point[0]) or not _number(point[1]) or not _positive(point[2]):
                raise KVStoreError("a recompute point must be (stored tokens, ratio, positive time share), not "
                                   f"{list(point)}")
        lengths = self._lengths()
        per_length = [[r for n, r, _ in self.recompute_points if n == length] for length in lengths]
        ratios = per_length[0] if per_length else []
        if not ratios or ratios[0] != 0.0 or ratios[-1] != 1.0 or ratios != sorted(set(ratios)):
            raise KVStoreError(f"the recompute curve needs increasing ratios from 0 to 1, got {ratios}")
        if any(rs != ratios for rs in per_length):
            raise KVStoreError("the recompute curve needs the same ratios at every length")

    def _lengths(self) -> list[int]:
        return sorted({n for n, _, _ in self.recompute_points})

    def prefill_s(self, num_tokens: int) -> float:
        """Full-prefill time of ``num_tokens``: piecewise linear through (0, 0) and the measured
        points, extended past the last point with the last segment's per-token slope (attention
        makes the curve slightly convex, so measure near the lengths you serve)."""
        pts = [(0, 0.0), *sorted(self.prefill_points)]
        return _interpolate([float(n) for n, _ in pts], [s for _, s in pts], float(num_tokens))

    def _curve(self, num_tokens: int) -> tuple[list[float], list[float]]:
        """The recompute curve for ``num_tokens`` stored tokens: linear between the two measured lengths
        around it (the nearest one's outside them), made monotone by a running maximum: a pass that
        recomputes more is never assumed faster, though one measured point may be (at 50% a scattered
        pass can lose to 100%'s)."""
        lengths = self._lengths()
        curves = [[f for m, _, f in self.recompute_points if m == n] for n in lengths]
        ratios = [r for m, r, _ in self.recompute_points if m == lengths[0]]
        x = min(max(float(num_tokens), lengths[0]), lengths[-1])
        raw = [_interpolate([float(n) for n in lengths], list(column), x) if len(lengths) > 1 else column[0]
               for column in zip(*curves, strict=True)]
        fractions: list[float] = []
        for f in raw:
            fractions.append(max(f, fractions[-1]) if fractions else f)
        return ratios, fractions

    def recompute_s(self, ratio: float, num_tokens: int) -> float:
        """Compute time of a fused pass over ``num_tokens`` recomputing ``ratio`` of the stored tokens:
        the curve's fraction at ``ratio`` (piecewise linear) of a full prefill's time of as many tokens."""
        ratios, fractions = self._curve(num_tokens)
        return _interpolate(ratios, fractions, min(max(ratio, 0.0), 1.0)) * self.prefill_s(num_tokens)

    def ratio_for(self, seconds: float, num_tokens: int) -> float:
        """The ratio whose fused pass takes ``seconds`` (0 below the curve's start, 1 past its end)."""
        ratios, fractions = self._curve(num_tokens)
        target = seconds / self.prefill_s(num_tokens)
        if target <= fractions[0]:
            return 0.0
        if target >= fractions[-1]:
            return 1.0
        return _interpolate(fractions, ratios, target)

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
            d["recompute_points"] = [tuple(p) for p in d["recompute_points"]]
            return cls(**d)
        except KVStoreError as exc:
            why = str(exc)
        except KeyError as exc:
            why = f"no {exc}"
        except (OSError, ValueError) as exc:
            why = f"not a profile's JSON: {exc}"
        except TypeError:  # a list where an object belongs, a number where a list does, an unknown field
            why = "its fields are not a delay profile's"
        raise KVStoreError(f"delay profile {path} is unusable ({why}): run `ragfuse profile` again")


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: object) -> bool:
    return _number(x) and x > 0  # type: ignore[operator]


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """y at ``x`` on the polyline through (xs, ys), xs increasing (flat steps: the step's start)."""
    j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[j - 1], ys[j - 1]), (xs[j], ys[j])
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def profile_path(cache_dir: str | Path, model: str, device: str, dtype: str) -> Path:
    tag = hashlib.blake2b(f"{model}|{device}|{dtype}".encode(), digest_size=8).hexdigest()
    return Path(cache_dir) / f"profile-{tag}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_prefill(
    compute_kv: Callable[[list[list[int]]], object], lengths: Sequence[int], vocab_size: int,
    device: torch.device, repeats: int = 2, progress: Callable[[], object] | None = None,
) -> list[tuple[int, float]]:
    """Wall time of a full prefill (KV capture) of random tokens at each length, the fastest of
    ``repeats`` (other work on a shared machine only adds time); ``progress`` is called once a length
    (seconds each on CPU)."""
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
        points.append((n, min(times)))
        if progress is not None:
            progress()
    return points


def synthetic_entry(key: str, num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> StoredKV:
    """An entry of a model's real shape filled with random values (bandwidth does not depend on them)."""
    k = torch.randn(num_layers, num_tokens, num_kv_heads, head_dim).to(dtype)
    return StoredKV.from_kv(key, k, torch.randn_like(k, dtype=torch.float32).to(dtype))


def measure_read_bandwidth(tier: Tier, entries: Sequence[StoredKV], device: torch.device, repeats: int = 3) -> float:
    """Bytes/s of loading ``entries`` from ``tier`` into ``device`` memory as a fused prefill loads its
    chunks: by the fusor's own ``LayerPrefetcher``, every entry's layer i together, its reader threads
    side by side (page cache dropped before every read, so a disk is really read), timed as a pass
    times its loading (``load_s``: the longer of the reads and the device copies), the median of
    ``repeats``: a disk's rate varies from read to read (an H200's 1.35-2.0 GB/s within minutes), and
    the fastest read promised passes a load they then waited for. Reading an entry at a time, one
    layer after the other, undercounted the rate instead: 1.22-1.48 GB/s from that disk. The entries
    are stored first and deleted after."""
    from ..fusion.prefetch import LayerPrefetcher
    from .source import open_source
    from .store import TieredKVStore

    store = TieredKVStore([tier])
    for e in entries:
        tier.put(e, keep_evicted=False)
    try:
        times = []
        for attempt in range(repeats + 1):  # the first, untimed, faults in the host buffers a server reuses
            for e in entries:
                tier.drop_cache(e.key)
            sources = [open_source(store, e.key) for e in entries]
            if None in sources:
                for src in sources:
                    if src is not None:
                        src.finish()
                raise KVStoreError(f"tier {tier.name!r} lost an entry while being profiled (capacity too small?)")
            with LayerPrefetcher(sources, entries[0].meta.num_layers, device) as loader:
                for layer in range(entries[0].meta.num_layers):
                    loader.get(layer)
            _sync(device)
            for src in sources:
                src.finish()
            if attempt:
                times.append(loader.load_s)
    finally:
        for e in entries:
            tier.delete(e.key)
    return sum(e.nbytes for e in entries) / statistics.median(times)
