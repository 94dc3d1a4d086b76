"""``ragfuse bench store``: how fast stored KV reaches the compute device from each tier.

Reads the KV of ``--chunks`` chunks x ``--tokens`` tokens of a Mistral-7B-shaped model (32 layers,
8 KV heads, head_dim 128, bf16: 128 KiB per token) from each tier into device memory, next to the
raw bandwidth of the same path measured in the same run:
- on CUDA: CPU (pinned) tier -> GPU against a plain pinned host-to-device copy of the same bytes
  (goal: at least 80%); disk -> GPU and Redis -> GPU; the GPU tier is already resident;
- on CPU: disk -> CPU against a raw sequential read of the very same files (goal: at least 70%),
  Redis -> CPU; the CPU tier is already resident.

Disk reads are compared like with like: the raw read and the tier read of the same files take
turns within each repeat (contention from other users of the machine hits both alike), and each
pass starts with the page cache of those files dropped (posix_fadvise DONTNEED), so the disk is
really read. The raw read is ``cat``'s: 128 KiB ``readinto`` calls into one buffer reused across
passes (on the CPU machine it beat one whole-file read by 10-15%); the tier reads into its host buffer pool, which
the warm-up pass fills, as a serving process that keeps reading chunks would. For reference the
same tier read into fresh buffers (no pool) and both reads from a warm page cache are listed too,
with the minor page faults each pass took.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
}
GOALS = {"cpu": 0.80, "disk": 0.70}
RAW_BLOCK = 128 << 10


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("store", help="KV read bandwidth from each tier vs the raw bandwidth of that path")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="device memory the KV is read into (cuda: the GPU; cpu: host memory)")
    p.add_argument("--chunks", type=int, default=6, help="chunks of KV read per pass")
    p.add_argument("--tokens", type=int, default=512, help="tokens per chunk (Mistral-7B shape: 128 KiB of KV a token)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of each read, the median reported")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis server for the remote tier "
                   "(skipped, and said so in the results, when it is not reachable)")
    p.add_argument("--dir", help="directory for the disk tier (default: a temporary one under --out)")
    p.add_argument("--out", default="bench-results/store", help="output folder (default bench-results/store)")
    p.set_defaults(func=run)


def _median_time(fn: Callable[[], Any], before: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocator, first-touch page faults, connections
    times = []
    for _ in range(repeats):
        before()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _side_by_side(
    fns: dict[str, Callable[[], Any]], before: Callable[[], None], sync: Callable[[], None], repeats: int,
) -> dict[str, tuple[list[float], list[int]]]:
    """Seconds and minor page faults of every pass of each function, timed in turns.

    Each repeat runs every function once, in an order rotated by one per repeat, so neither a burst
    of load from other processes nor a drift of the machine favours one of them.
    """
    from tqdm.auto import tqdm

    names = list(fns)
    for fn in fns.values():
        fn()  # warm-up: allocator, buffer pool, connections
    passes: dict[str, tuple[list[float], list[int]]] = {n: ([], []) for n in names}
    for r in tqdm(range(repeats), desc=f"bench store [{', '.join(names)}]"):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before()
            sync()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fns[name]()
            sync()
            passes[name][0].append(time.perf_counter() - t0)
            passes[name][1].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return passes


def run(args: argparse.Namespace) -> int:
    import torch

    from ragfuse.bench.partial import Report
    from ragfuse.bench.report import machine_info, prepare_out_dir
    from ragfuse.engine import ModelConfig
    from ragfuse.engine.errors import RagfuseError
    from ragfuse.engine.kvstore import DiskTier, KVStoreError, MemoryTier, RedisTier
    from ragfuse.engine.kvstore.buffer_pool import HostBufferPool
    from ragfuse.engine.kvstore.disk import drop_page_cache
    from ragfuse.engine.kvstore.profile import synthetic_entry

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda was asked for but no CUDA device is available")
    if args.chunks < 1 or args.tokens < 1 or args.repeats < 1:
        raise RagfuseError("--chunks, --tokens and --repeats must be at least 1")
    if args.dir:
        prepare_out_dir(args.dir, "--dir")
    device = torch.device(args.device)
    mc = ModelConfig.from_dict(MISTRAL_7B)
    dtype = torch.bfloat16
    entries = [synthetic_entry(f"bench-{i}", mc.num_layers, args.tokens, mc.num_kv_heads, mc.head_dim, dtype)
               for i in range(args.chunks)]
    total = sum(e.nbytes for e in entries)
    assert total == args.chunks * args.tokens * mc.kv_bytes_per_token(dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    nothing = lambda: None  # noqa: E731 - used as "no preparation"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    samples_ms: dict[str, dict[str, list[float]]] = {}  # every pass of the disk rows, in the order run
    results = {
        "bench": "store", "machine": machine_info(str(device)), "model_shape": "Mistral-7B (32 layers, 8 kv heads, "
        "head_dim 128, bf16)", "kv_bytes_per_token": mc.kv_bytes_per_token(dtype), "chunks": args.chunks,
        "tokens_per_chunk": args.tokens, "total_bytes": total, "repeats": args.repeats, "notes": notes,
        "load_average_before": os.getloadavg(),  # the machine may be shared: say how busy it was
        "samples_ms": samples_ms,
    }
    parts = [f"disk -> {device.type}", *(["disk -> cpu, page cache warm"] if device.type == "cpu" else []),
             f"{device.type} tier", f"redis -> {device.type}"]
    report = Report(out, "KV store read bandwidth", results, parts, notes=lambda: "\n".join(f"- {n}" for n in notes))
    rows = report.rows

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        measured = [r for r in rows if r["GB/s"] or r["raw GB/s"]]
        xs = range(len(measured))
        ax.bar([x - 0.2 for x in xs], [r["GB/s"] or 0 for r in measured], width=0.4, label="tier read")
        ax.bar([x + 0.2 for x in xs], [r["raw GB/s"] or 0 for r in measured], width=0.4, label="raw path")
        ax.set_xticks(list(xs), [r["path"] for r in measured], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"KV of {args.chunks} x {args.tokens} tokens (Mistral-7B shape, {total / 2**20:.0f} MiB)")
        for x, r in zip(xs, measured):
            if r["ratio"]:
                ax.annotate(f"{r['ratio']:.0%}", (x - 0.2, r["GB/s"]), ha="center", va="bottom", fontsize=8)
        ax.legend()

    report.plot = plot

    def row(path: str, seconds: float | None, raw_name: str, raw_s: float | None, goal: float | None,
            faults: tuple[float, float] | None = None) -> None:
        gbs = total / seconds / 1e9 if seconds else None
        raw = total / raw_s / 1e9 if raw_s else None
        ratio = gbs / raw if gbs and raw else None
        rows.append({"path": path, "MB": total / 1e6, "ms": seconds * 1e3 if seconds else None, "GB/s": gbs,
                     "raw path": raw_name, "raw GB/s": raw, "ratio": ratio, "goal": goal,
                     "met": None if goal is None or ratio is None else ratio >= goal,
                     "page faults": faults[0] if faults else None, "raw page faults": faults[1] if faults else None})

    cap = total + (64 << 20)
    with report.interruptible(), tempfile.TemporaryDirectory(dir=args.dir or out, prefix=".kv-") as tmp:
        report.begin(parts[0])
        disk = DiskTier(Path(tmp), cap * 2, reserve_bytes=0, read_pool=HostBufferPool(total + (64 << 20)))
        for e in entries:
            disk.put(e, keep_evicted=False)
        files = [disk.path_of(e.key) for e in entries]

        # raw sequential read of the very same files into one preallocated buffer
        view = memoryview(bytearray(max(f.stat().st_size for f in files)))

        def raw_read() -> None:
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    got = 0
                    while got < len(view) and (n := fh.readinto(view[got:got + RAW_BLOCK])):
                        got += n

        def drop_all() -> None:
            for f in files:
                drop_page_cache(f)

        reads = {"raw": raw_read, "tier": lambda: [disk.get(e.key, device) for e in entries]}
        if device.type == "cpu":  # the same store, read into fresh buffers: what the pool saves
            unpooled = DiskTier(Path(tmp), cap * 2, reserve_bytes=0, read_pool=HostBufferPool(0))
            reads["fresh"] = lambda: [unpooled.get(e.key, device) for e in entries]
        raw_name = f"sequential file read ({RAW_BLOCK >> 10} KiB reads)"

        def disk_row(path: str, passes: dict, name: str, raw: str, goal: float | None) -> None:
            (t, f), (raw_t, raw_f) = passes[name], passes["raw"]
            row(path, statistics.median(t), raw, statistics.median(raw_t), goal,
                (statistics.median(f), statistics.median(raw_f)))
            samples_ms[path] = {"tier": [x * 1e3 for x in t], "raw": [x * 1e3 for x in raw_t]}

        cold = _side_by_side(reads, drop_all, sync, args.repeats)
        disk_row(f"disk -> {device.type}", cold, "tier", raw_name, GOALS["disk"])
        if device.type == "cpu":
            disk_row("disk -> cpu, fresh buffers (no pool)", cold, "fresh", raw_name, None)
            report.begin(parts[1])
            warm = _side_by_side(reads, nothing, sync, args.repeats)
            disk_row("disk -> cpu, page cache warm", warm, "tier", "file read, page cache warm", None)
            disk_row("disk -> cpu, page cache warm, fresh buffers", warm, "fresh", "file read, page cache warm", None)
            notes.append("disk rows: page cache dropped before every pass of both the tier and the raw read, "
                         "unless the row says warm (then both read from a warm page cache)")
            unpooled.close()

        report.begin(f"{device.type} tier")
        if device.type == "cuda":
            gpu = MemoryTier("gpu", device, cap)
            for e in entries:
                gpu.put(e)
            row("gpu tier (resident)", None, "-", None, None)
            cpu = MemoryTier("cpu", "cpu", cap, pin=True)
            for e in entries:
                cpu.put(e)
            src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            dst = torch.empty(total, dtype=torch.uint8, device=device)
            raw_h2d = _median_time(lambda: dst.copy_(src, non_blocking=True), nothing, sync, args.repeats)
            cpu_s = _median_time(lambda: [cpu.get(e.key, device) for e in entries], nothing, sync, args.repeats)
            row("cpu pinned -> cuda", cpu_s, "pinned H2D copy", raw_h2d, GOALS["cpu"])
            notes.append(f"GPU: {torch.cuda.get_device_name(device)}")
        else:
            cpu = MemoryTier("cpu", "cpu", cap)
            for e in entries:
                cpu.put(e)
            src = torch.empty(total, dtype=torch.uint8)
            dst = torch.empty_like(src)
            raw_copy = _median_time(lambda: dst.copy_(src), nothing, nothing, args.repeats)
            row("cpu tier (resident)", None, "memory copy", raw_copy, None)
            notes.append("The CPU tier is the compute device's own memory: its KV is used in place, no copy. "
                         "The memory-copy bandwidth is listed for reference.")

        report.begin(f"redis -> {device.type}")
        try:
            redis = RedisTier(args.redis, cap, prefix=f"ragfuse:bench:{os.getpid()}")
        except KVStoreError as exc:
            notes.append(f"Redis tier skipped: {exc}")
        else:
            try:
                for e in entries:
                    redis.put(e, keep_evicted=False)
                redis_s = _median_time(lambda: [redis.get(e.key, device) for e in entries], nothing, sync,
                                       args.repeats)
                row(f"redis -> {device.type}", redis_s, "-", None, None)
            finally:
                for e in entries:
                    redis.delete(e.key)
                redis.close()
        disk.close()

    results["load_average_after"] = os.getloadavg()
    report.write()
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    for n in notes:
        print(n)
    print(f"results in {out}")
    return 0
