"""``ragfuse profile``: measure the delay profile the loading controller decides from, and cache it.

Prefill time is measured by running the engine's full prefill at a few context lengths; the
recompute curve by fused passes at several ratios over random prompts of ``--context`` stored tokens
and a quarter of it; tier bandwidth by reading entries of the model's real KV shape from each tier
into the compute device a layer at a time, as the fusor's loader does. The model is the store's: the
profile is read by the pipelines serving that store.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from ragfuse.commands.generate import add_model_args, positive_int
from ragfuse.commands.ingest import add_store_arg

# ratios the recompute curve is measured at (the controller interpolates between them); 1 ends it
RECOMPUTE_RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)
QUERY_TOKENS = 32  # the fused passes' computed query, as in `ragfuse bench fusion`
# the fused passes' first segment: a stored prompt start, as `ask`'s instruction prefix is. A prompt's
# first segment is an exact prefix, never recomputed, so without it the first chunk would not be either
# and 100% would time a pass recomputing only the chunks after it
PREFIX_TOKENS = 32


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="measure prefill time, fused-pass time and KV tier bandwidth for the loading controller",
        description="Measure, for the store's model on this device and dtype, full prefill times, fused passes "
                    "at recompute ratios 0-100% and each KV tier's read bandwidth, and cache them as the "
                    "store's delay profile (replacing the one before), which the loading controller of "
                    "`ragfuse ask` and `ragfuse serve` decides from. Needs an ingested store; about 90 s at "
                    "the defaults on a 2-core CPU.")
    add_model_args(p, store=True)
    add_store_arg(p)
    p.add_argument("--lengths", default="256,512,1024,2048",
                   help="comma-separated prompt lengths to time a full prefill at (default 256,512,1024,2048)")
    p.add_argument("--entry-tokens", type=positive_int, default=512,
                   help="tokens per chunk of the fused passes and per synthetic KV entry read from tiers "
                        "(default 512)")
    p.add_argument("--entries", type=positive_int, default=6,
                   help="entries read per bandwidth measurement (default 6)")
    p.add_argument("--redis", metavar="URL", help="also profile this Redis server")
    p.add_argument("--context", type=positive_int, default=3072,
                   help="stored tokens of the fused passes timed (also a quarter of it) and of the controller's "
                        "decision shown (default 3072)")
    p.add_argument("--r-star", type=r_star, default=0.15,
                   help="least recompute ratio, in (0, 1], for the decision shown here only (default 0.15; "
                        "ask's controller never goes below the gate's r*)")
    p.add_argument("--json", action="store_true", help="one JSON object: {profile, path, decision}")
    p.set_defaults(func=run)


def r_star(value: str) -> float:
    """``--r-star``: a recompute ratio in (0, 1], refused while parsing rather than after the measurement."""
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value!r}") from None
    if not 0.0 < r <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return r


def profile_prompt(engine, length: int, chunk_tokens: int):
    """The fused passes' prompt: a stored prompt start, ``length`` random stored tokens in chunks of
    ``chunk_tokens``, and a computed query (a ``StoredPrompt``, its KV in no tier yet)."""
    from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt

    whole, rest = divmod(length, chunk_tokens)
    sizes = [chunk_tokens] * whole + ([rest] if rest else [])
    chunks, query = random_prompt(engine.model_config.vocab_size, len(sizes) + 1, chunk_tokens, QUERY_TOKENS)
    return StoredPrompt(engine, [chunks[0][:PREFIX_TOKENS], *(c[:n] for c, n in zip(chunks[1:], sizes, strict=True))],
                        query)


def measure_recompute_curve(engine, context: int, chunk_tokens: int) -> list[tuple[int, float, float]]:
    """The controller's recompute curve at a quarter of ``context`` stored tokens and at ``context``
    (a fused pass's fixed costs weigh more in a short prompt): fused passes over ``profile_prompt``,
    its KV resident on the compute device, so only compute is timed."""
    from ragfuse.engine.kvstore import MemoryTier

    lengths = sorted({max(context // 4, 1), context})
    points: list[tuple[int, float, float]] = []
    with tqdm(total=len(lengths) * (len(RECOMPUTE_RATIOS) + 1), desc="fused passes") as bar:
        for length in lengths:
            prompt = profile_prompt(engine, length, chunk_tokens)
            tier = MemoryTier("gpu" if engine.device.type == "cuda" else "cpu", engine.device, prompt.kv_bytes * 2)
            prompt.keep_in(tier)
            curve = prompt.recompute_curve(tier.name, list(RECOMPUTE_RATIOS), repeats=2, progress=bar)
            points += [(length, r, f) for r, f in curve]
            tier.close()
    return points


def measure_profile(engine, lengths: list[int], context: int, entry_tokens: int, entries: int, disk_root: Path,
                    redis_url: str | None = None):
    """The delay profile of ``engine`` on its device: full prefills at ``lengths``, the recompute curve
    over ``context`` stored tokens, and each tier's bandwidth (the disk tier under ``disk_root``)."""
    from ragfuse.engine.kvstore import DelayProfile, measure_prefill, measure_read_bandwidth
    from ragfuse.engine.kvstore.entry import dtype_name
    from ragfuse.engine.kvstore.profile import synthetic_entry

    mc = engine.model_config
    with tqdm(total=len(lengths), desc="full prefills") as bar:
        points = measure_prefill(engine.compute_kv, lengths, mc.vocab_size, engine.device, progress=bar.update)
    curve = measure_recompute_curve(engine, context, entry_tokens)
    kv = [synthetic_entry(f"profile-{i}", mc.num_layers, entry_tokens, mc.num_kv_heads, mc.head_dim, engine.dtype)
          for i in range(entries)]
    bandwidth = {}
    for tier in build_tiers(engine.device, kv[0].nbytes, len(kv), disk_root, redis_url):
        bandwidth[tier.name] = measure_read_bandwidth(tier, kv, engine.device)
        tier.close()
    return DelayProfile(
        model=engine.fingerprint, device=str(engine.device), dtype=dtype_name(engine.dtype),
        kv_bytes_per_token=mc.kv_bytes_per_token(engine.dtype), prefill_points=points, recompute_points=curve,
        bandwidth=bandwidth, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


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
    from ragfuse.app import serving_model, store_profile_path
    from ragfuse.bench.report import prepare_out_dir
    from ragfuse.engine import EngineConfig, LLMEngine
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.engine.kvstore import LoadingController, check_redis
    from ragfuse.store_dir import StoreError, ingested_store

    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError as exc:
        raise RagfuseError(f"--lengths must be comma-separated whole numbers, got {args.lengths!r}") from exc
    if not lengths or lengths[0] < 1:
        raise RagfuseError("--lengths needs positive token counts")
    # the profile's folder is made and checked before the model loads and the measurement runs: a
    # store path that is a file, or a profiles/ that is one, would otherwise fail only at the save
    check_redis(args.redis)  # before the model loads and the prefill is measured
    root, config = ingested_store(args.store)  # a profile is read only from a store's folder, for its model
    serving_model(root, args.model)
    prepare_out_dir(root / "profiles", "--store")
    engine = LLMEngine(EngineConfig(model=config.model, device=args.device, dtype=args.dtype))
    if lengths[-1] > engine.max_model_len:
        raise RagfuseError(f"--lengths goes past the model's context of {engine.max_model_len}")
    if PREFIX_TOKENS + args.context + QUERY_TOKENS > engine.max_model_len:  # passes the model cannot take
        raise RagfuseError(f"--context {args.context} goes past the model's context of {engine.max_model_len} "
                           f"(with a {PREFIX_TOKENS}-token prompt start and a {QUERY_TOKENS}-token query)")
    if args.entry_tokens > engine.max_model_len:  # an entry no prompt of this model could hold
        raise RagfuseError(f"--entry-tokens {args.entry_tokens} goes past the model's context of "
                           f"{engine.max_model_len}")
    target = store_profile_path(root, engine)
    if target.is_dir():  # the save would fail only after the whole measurement
        raise StoreError(f"{target} is a folder where this model's profile belongs: remove it first")
    with tempfile.TemporaryDirectory(dir=root, prefix=".profile-") as tmp:
        prof = measure_profile(engine, lengths, args.context, args.entry_tokens, args.entries, Path(tmp), args.redis)
    points, curve, bandwidth = prof.prefill_points, prof.recompute_points, prof.bandwidth
    path = prof.save(target)
    decision = LoadingController(prof, r_star=args.r_star).choose_tier(args.context)
    if args.json:
        print(json.dumps({"profile": prof.__dict__, "path": str(path), "decision": decision.as_dict()}))
        return 0
    for n, s in points:
        print(f"prefill {n:6d} tokens: {s * 1e3:9.1f} ms ({s / n * 1e6:.1f} us/token)")
    for length in sorted({n for n, _, _ in curve}):
        print(f"fused pass over {length:5d} stored tokens, time as a share of a full prefill's: "
              + ", ".join(f"{f:.2f} at {r:.0%}" for n, r, f in curve if n == length))
    # the tier in the compute device's own memory hands its tensors over where they lie: what it times
    # is a lookup, not a read (thousands of GB/s), so it is named for what it is
    resident = "gpu" if engine.device.type == "cuda" else "cpu"
    for name, bw in bandwidth.items():
        print(f"read from {name:6s}: " + ("resident, used in place (no copy)" if name == resident
                                          else f"{bw / 1e9:8.2f} GB/s"))
    print(f"profile saved to {path} (read where this store's model, {config.model}, runs on {prof.device} in "
          f"{prof.dtype})")
    print(f"for {args.context} tokens: store in {decision.tier}, recompute {decision.recompute_ratio:.1%} "
          f"({decision.reason}); TTFT about {decision.ttft_estimate_s * 1e3:.1f} ms")
    return 0
