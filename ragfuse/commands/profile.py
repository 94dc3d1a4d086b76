"""``ragfuse profile``: measure the delay profile the loading controller decides from, and cache it.

Prefill time is measured by running the engine's full prefill at a few context lengths; tier
bandwidth by reading entries of the model's real KV shape from each tier into the compute device.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from ragfuse.commands.generate import add_model_args, positive_int
from ragfuse.commands.ingest import add_store_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure prefill time and KV tier bandwidth for the loading controller")
    add_model_args(p)
    add_store_arg(p)
    p.add_argument("--lengths", default="256,512,1024,2048", help="context lengths to time a full prefill at")
    p.add_argument("--entry-tokens", type=positive_int, default=512,
                   help="tokens per synthetic KV entry read from tiers")
    p.add_argument("--entries", type=positive_int, default=6, help="entries read per bandwidth measurement")
    p.add_argument("--redis", metavar="URL", help="also profile this Redis server")
    p.add_argument("--context", type=positive_int, default=3072,
                   help="show the controller's decision for this many tokens")
    p.add_argument("--r-star", type=r_star, default=0.15, help="least recompute ratio that keeps quality")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def r_star(value: str) -> float:
    """``--r-star``: a recompute ratio in (0, 1], refused while parsing rather than after the measurement."""
    r = float(value)
    if not 0.0 < r <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return r


def build_tiers(device, entry_bytes: int, entries: int, disk_root: Path, redis_url: str | None) -> list:
    """One tier of each kind that makes sense on ``device``, each big enough for the measurement."""
    import torch

    from ragfuse.engine.kvstore import DiskTier, MemoryTier, RedisTier

    cap = entry_bytes * (entries + 1)
    tiers: list = []
    if device.type == "cuda":
        tiers.append(MemoryTier("gpu", device, cap))
    tiers.append(MemoryTier("cpu", "cpu", cap, pin=torch.cuda.is_available()))
    tiers.append(DiskTier(disk_root, cap * 2, reserve_bytes=0))
    if redis_url:
        tiers.append(RedisTier(redis_url, cap, prefix="ragfuse:profile"))
    return tiers


def run(args: argparse.Namespace) -> int:
    from ragfuse.bench.report import prepare_out_dir
    from ragfuse.engine import EngineConfig, LLMEngine
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.engine.kvstore import (
        DelayProfile,
        LoadingController,
        check_redis,
        measure_prefill,
        measure_read_bandwidth,
        profile_path,
    )
    from ragfuse.engine.kvstore.entry import dtype_name
    from ragfuse.engine.kvstore.profile import synthetic_entry
    from ragfuse.store_dir import StoreError, resolve_store_dir

    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError as exc:
        raise RagfuseError(f"--lengths must be comma-separated integers: {exc}") from exc
    if not lengths or lengths[0] < 1:
        raise RagfuseError("--lengths needs positive token counts")
    # the profile's folder is made and checked before the model loads and the measurement runs: a
    # store path that is a file, or a profiles/ that is one, would otherwise fail only at the save
    root = resolve_store_dir(args.store)
    named = args.store or os.environ.get("RAGFUSE_STORE")
    if named and not root.exists():  # a mistyped store would get a new folder holding nothing but the profile
        raise StoreError(f"no store at {root} (pass an existing --store, or run `ragfuse ingest` first)")
    prepare_out_dir(root / "profiles", "--store")
    check_redis(args.redis)  # before the model loads and the prefill is measured
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    if lengths[-1] > engine.max_model_len:
        raise RagfuseError(f"--lengths goes past the model's context of {engine.max_model_len}")
    if args.context > engine.max_model_len:  # a decision for prompts the model cannot take
        raise RagfuseError(f"--context {args.context} goes past the model's context of {engine.max_model_len}")
    mc = engine.model_config
    points = measure_prefill(engine.compute_kv, lengths, mc.vocab_size, engine.device)
    entries = [synthetic_entry(f"profile-{i}", mc.num_layers, args.entry_tokens, mc.num_kv_heads, mc.head_dim,
                               engine.dtype) for i in range(args.entries)]
    bandwidth = {}
    with tempfile.TemporaryDirectory(dir=root, prefix=".profile-") as tmp:
        for tier in build_tiers(engine.device, entries[0].nbytes, len(entries), Path(tmp), args.redis):
            bandwidth[tier.name] = measure_read_bandwidth(tier, entries, engine.device)
            tier.close()
    prof = DelayProfile(
        model=engine.fingerprint, device=str(engine.device), dtype=dtype_name(engine.dtype),
        kv_bytes_per_token=mc.kv_bytes_per_token(engine.dtype), prefill_points=points, bandwidth=bandwidth,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    path = prof.save(profile_path(root / "profiles", prof.model, prof.device, prof.dtype))
    decision = LoadingController(prof, r_star=args.r_star).choose_tier(args.context)
    if args.json:
        print(json.dumps({"profile": prof.__dict__, "path": str(path), "decision": decision.as_dict()}))
        return 0
    for n, s in points:
        print(f"prefill {n:6d} tokens: {s * 1e3:9.1f} ms ({s / n * 1e6:.1f} us/token)")
    # the tier in the compute device's own memory hands its tensors over where they lie: what it times
    # is a lookup, not a read (thousands of GB/s), so it is named for what it is
    resident = "gpu" if engine.device.type == "cuda" else "cpu"
    for name, bw in bandwidth.items():
        print(f"read from {name:6s}: " + ("resident, used in place (no copy)" if name == resident
                                          else f"{bw / 1e9:8.2f} GB/s"))
    print(f"profile saved to {path}")
    print(f"for {args.context} tokens: store in {decision.tier}, recompute {decision.recompute_ratio:.1%} "
          f"({decision.reason})")
    return 0
