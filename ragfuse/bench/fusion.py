"""``ragfuse bench fusion``: TTFT of each fusion mode with chunk KV in the CPU and disk tiers.

A RAG prompt of ``--chunks`` stored chunks and a computed query. For each tier the chunks' KV is
stored there and every mode runs its fused prefill from it (page cache dropped before each disk
run, so the disk is really read). Reported per run: TTFT, the loading and the compute time, and
how much of the shorter of the two was hidden behind the other by the layer pipeline (and TTFT
against the longer one: the same goal read where one part is a sliver of the other). A delay
profile is then built from this run's own measurements and the loading controller picks each
tier's ratio: where loading is slower than recompute at r*, the ratio rises to fill that time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .args import choice_list, positive_int, ratio_list, unit_ratio
from .partial import Report
from .report import machine_info, markdown_table, speed_phrase
from .shapes import SHAPES
from .stored_prompt import StoredPrompt, random_prompt

TIERS = ("cpu", "disk", "gpu")
RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
PARTS = ("modes", "ratio sweep", "controller")  # each model's, in the order they run


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fusion", help="TTFT per fusion mode and KV tier, load/compute overlap")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device the engine runs on (without --shape: cuda a random-weight mistral-7b, cpu --model)")
    p.add_argument("--shape", action="append", default=None, choices=SHAPES,
                   help="random-weight shape(s) (cuda default: mistral-7b); cpu default: the default model")
    p.add_argument("--model", default="smollm2-135m-instruct", help="real weights (used when --shape is not given)")
    p.add_argument("--chunks", type=positive_int, default=6, help="stored chunks in the RAG prompt")
    p.add_argument("--chunk-tokens", type=positive_int, default=512, help="tokens per stored chunk")
    p.add_argument("--query-tokens", type=positive_int, default=32,
                   help="tokens of the query, computed after the chunks")
    p.add_argument("--ratio", type=unit_ratio, default=0.15, help="r* for the fuse rows")
    p.add_argument("--tiers", type=choice_list(TIERS), default=["cpu", "disk"], help="comma-separated: cpu, disk, gpu")
    p.add_argument("--sweep", type=ratio_list, default=list(RATIOS),
                   help="ratios for the TTFT-vs-ratio curve (CPU tier)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="passes per mode and tier, the median reported (default 5 on CUDA, 3 on CPU)")
    p.add_argument("--out", default=None, help="output folder (default bench-results/fusion-DEVICE)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    shapes = args.shape or (["mistral-7b"] if args.device == "cuda" else [None])
    if args.repeats is None:  # a GPU pass is milliseconds: more of them steady the median
        args.repeats = 5 if args.device == "cuda" else 3
    tiers = args.tiers
    if "gpu" in tiers and args.device != "cuda":
        raise RagfuseError("--tiers gpu needs --device cuda")
    sweeps: dict[str, list[dict[str, Any]]] = {}
    extra: dict[str, Any] = {}
    results = {"benchmark": "fusion", "machine": machine_info(args.device), "sweeps": sweeps, "per_model": extra,
               "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    labels = [shape or args.model for shape in shapes]
    report = Report(args.out or f"bench-results/fusion-{args.device}", "ragfuse bench fusion", results,
                    [f"{part} [{label}]" for label in labels for part in PARTS],
                    plot=lambda fig: _plot(fig, report.rows, sweeps),
                    notes=lambda: "\n".join([_notes(report.rows),
                                             *(f"- {name}: {ex['skipped']}" for name, ex in extra.items()
                                               if "skipped" in ex),
                                             *(_sweep_table(name, pts) for name, pts in sweeps.items() if pts)]))
    with report.interruptible():
        for shape, label in zip(shapes, labels, strict=True):
            first = len(report.rows)
            sweeps[label], extra[label] = [], {}
            try:
                bench_shape(args, shape, tiers, report, sweeps[label], extra[label])
            except torch.OutOfMemoryError as exc:  # a big shape on a small GPU: said in the report, the rest still runs
                print(f"bench fusion [{shape}]: skipped, out of GPU memory ({str(exc).splitlines()[0]})", flush=True)
                del report.rows[first:], sweeps[label]
                extra[label] = {"skipped": f"out of GPU memory: {str(exc).splitlines()[0]}"}
            gc.collect()  # the engine holds reference cycles: free its weights before the next shape's
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    path = report.write()
    print((path / "results.md").read_text())
    return 0


def _engine(args: argparse.Namespace, shape: str | None) -> Any:
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

    n = args.chunks * args.chunk_tokens + args.query_tokens
    if shape is None:
        return LLMEngine(EngineConfig(model=args.model, device=args.device, max_model_len=max(n + 64, 4096)))
    from .shapes import shape_config

    cfg = shape_config(shape)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], max(n + 64, 8192))
    mc = ModelConfig.from_dict(cfg)
    budget = int(mc.kv_bytes_per_token(torch.bfloat16) * (n + 256) * 3)
    return LLMEngine(EngineConfig(device=args.device, kv_cache_bytes=budget), random_weights=mc)


def bench_shape(
    args: argparse.Namespace, shape: str | None, tiers: list[str], report: Report, sweep: list[dict[str, Any]],
    info: dict[str, Any],
) -> None:
    """Every mode and tier of one model (``shape``, or the real ``--model``), then the controller's
    ratios and the ratio sweep: their rows go to ``report.rows``, the sweep's points to ``sweep``, the
    model's sizes and measured bandwidths to ``info``, each as soon as it is measured (a run stopped
    part way keeps them)."""
    from ragfuse.engine.fusion import SelectionPolicy
    from ragfuse.engine.kvstore import DelayProfile, DiskTier, LoadingController, MemoryTier

    label = shape or args.model
    report.begin(f"{PARTS[0]} [{label}]")
    eng = _engine(args, shape)
    name = shape or eng.model_name
    mc = eng.model_config
    chunks, query = random_prompt(mc.vocab_size, args.chunks, args.chunk_tokens, args.query_tokens)
    n_ctx = args.chunks * args.chunk_tokens
    print(f"bench fusion [{name}]: computing {args.chunks} x {args.chunk_tokens}-token chunks' KV", flush=True)
    prompt = StoredPrompt(eng, chunks, query)
    policy = SelectionPolicy.default()
    first = len(report.rows)
    rows = report.rows
    measured: dict[str, float] = {}
    info.update(context_tokens=n_ctx, kv_bytes=prompt.kv_bytes, bandwidth_measured=measured)
    with tempfile.TemporaryDirectory(prefix="ragfuse-bench-fusion-") as tmp:
        for tier in tiers:
            cap = prompt.kv_bytes * 2
            prompt.keep_in(DiskTier(Path(tmp) / "kv", cap, reserve_bytes=0) if tier == "disk" else
                           MemoryTier(tier, eng.device if tier == "gpu" else "cpu", cap,
                                      pin=tier == "cpu" and torch.cuda.is_available()))

        def fused(tier: str, mode: str, ratio: float, loaded: int | None = None) -> dict[str, float]:
            st = prompt.median(tier, mode, policy.with_ratio(ratio), args.repeats, loaded)
            shorter = min(st.load_s, st.compute_s) if st.load_s > 0 else 0.0
            hidden = (st.load_s - st.load_wait_s) / shorter if shorter > 0 else 1.0
            return {"ttft_s": st.total_s, "load_s": st.load_s, "compute_s": st.compute_s,
                    "load_wait_s": st.load_wait_s, "hidden": min(1.0, max(0.0, hidden)),
                    "ttft_vs_longer": st.total_s / max(st.load_s, st.compute_s), "ratio": st.recompute_ratio}

        # one pass a mode compiles its kernels, captures its graphs and fills the allocator's pools (a CPU's
        # full prefill of the default model takes seconds: --repeats of them each was minutes of warm-up)
        for mode in tqdm(("full", "prefix", "reuse", "fuse"), desc=f"warm-up [{name}]"):
            prompt.run(tiers[0], mode, policy.with_ratio(args.ratio if mode == "fuse" else 0.0))
        jobs = [(t, m) for t in tiers for m in ("full", "prefix", "reuse", "fuse")]
        for tier, mode in tqdm(jobs, desc=f"bench fusion [{name}]"):
            res = fused(tier, mode, args.ratio if mode == "fuse" else 0.0)
            rows.append({"model": name, "tier": tier, "mode": mode, **res})
            if mode == "reuse":
                measured[tier] = prompt.kv_bytes / max(res["load_s"], 1e-9)
        mine = rows[first:]
        full = next(r for r in mine if r["mode"] == "full")
        for tier in tiers:
            for mode in ("prefix", "reuse", "fuse"):
                row = next(r for r in mine if r["tier"] == tier and r["mode"] == mode)
                row["speedup_vs_full"] = full["ttft_s"] / row["ttft_s"]
        prefix = {r["tier"]: r["ttft_s"] for r in mine if r["mode"] == "prefix"}
        for r in mine:
            if r["mode"] == "fuse":
                r["speedup_vs_prefix"] = prefix[r["tier"]] / r["ttft_s"]
        report.begin(f"{PARTS[1]} [{label}]")  # its reference logits are part of it
        with torch.inference_mode():
            ref = _first_logits(eng, chunks, query) if shape is None else None
        for ratio in tqdm(args.sweep, desc="ratio sweep"):
            res = fused(tiers[0], "fuse" if ratio > 0 else "reuse", ratio)
            point = {"ratio": ratio, **res}
            if ref is not None:
                point["kl_first"] = _kl_at(eng, prompt, ratio, policy, ref)
            sweep.append(point)
        # the controller decides from this run's own measurements: the sweep is its recompute curve
        curve = {0.0: next(r for r in mine if r["mode"] == "reuse")["compute_s"], 1.0: full["compute_s"],
                 **{r: p["compute_s"] for r, p in zip(args.sweep, sweep, strict=True)}}
        profile = DelayProfile(
            model=name, device=str(eng.device), dtype=str(eng.dtype), kv_bytes_per_token=prompt.kv_bytes // n_ctx,
            prefill_points=[(n_ctx + args.query_tokens, full["compute_s"])],
            recompute_points=[(n_ctx, r, t / full["compute_s"]) for r, t in sorted(curve.items())],
            bandwidth=measured,
        )
        controller = LoadingController(profile, r_star=args.ratio)
        report.begin(f"{PARTS[2]} [{label}]")
        for tier in tqdm(tiers, desc="controller"):
            decision = controller.decide(n_ctx, tier, sources=[args.chunk_tokens] * args.chunks, exact_prefix=True)
            if decision.loaded_sources is not None:  # its first pass at this size captures graphs: untimed
                prompt.run(tier, "fuse", policy.with_ratio(decision.recompute_ratio), decision.loaded_sources)
            res = fused(tier, "fuse", decision.recompute_ratio, decision.loaded_sources)
            loaded = decision.loaded_sources or (1 if decision.recompute_ratio >= 1.0 else args.chunks)
            rows.append({"model": name, "tier": tier, "mode": "fuse@controller", **res, "chunks_loaded": loaded,
                         "speedup_vs_full": full["ttft_s"] / res["ttft_s"], "controller_reason": decision.reason,
                         "ttft_estimate_s": decision.ttft_estimate_s})


def _first_logits(eng: Any, chunks: list[list[int]], query: list[int]) -> torch.Tensor:
    return eng.score([t for c in chunks for t in c] + query, last_n=1)[0]


def _kl_at(eng: Any, prompt: StoredPrompt, ratio: float, policy: Any, ref: torch.Tensor) -> float:
    """First-token KL of fusion at ``ratio`` from full prefill (meaningful with real weights only)."""
    from ragfuse.engine.fusion import Segment
    from ragfuse.engine.kvstore import open_source
    from ragfuse.quality import kl_rows

    store = next(iter(prompt.stores.values()))
    segs = [Segment(c, open_source(store, k)) for c, k in zip(prompt.chunks, prompt.keys, strict=True)]
    logits, _ = eng.score_fused([*segs, Segment(prompt.query)], [], "fuse" if ratio > 0 else "reuse",
                                policy.with_ratio(ratio))
    return float(kl_rows(ref[None], logits)[0])


def _notes(rows: list[dict[str, Any]]) -> str:
    lines = ["TTFT = fused prefill incl. KV loading (median of repeats). hidden = share of the shorter of "
             "loading and compute that overlapped the other; ttft_vs_longer = TTFT / the longer of the two "
             "(1 when the pipeline hides the shorter one whole)."]
    for r in rows:
        if r["mode"] == "fuse" and "speedup_vs_prefix" in r:
            lines.append(f"- {r['model']} {r['tier']}: fuse@{r['ratio']:.0%} is {speed_phrase(r['speedup_vs_full'])} "
                         f"than full and {speed_phrase(r['speedup_vs_prefix'])} than prefix; {r['hidden']:.0%} hidden, "
                         f"TTFT {r['ttft_vs_longer']:.2f}x the longer part")
        if r["mode"] == "fuse@controller":
            lines.append(f"- {r['model']} {r['tier']}: controller ratio {r['ratio']:.0%}, {r['chunks_loaded']} "
                         f"chunk(s) loaded, {speed_phrase(r['speedup_vs_full'])} than full ({r['controller_reason']})")
    return "\n".join(lines)


def _sweep_table(name: str, points: list[dict[str, Any]]) -> str:
    """The ratio sweep of one model as a table of its own (the plot's numbers, for readers of the text)."""
    keys = [k for k in ("ratio", "ttft_s", "load_s", "compute_s", "hidden", "kl_first") if k in points[0]]
    return f"\nRatio sweep, {name} (the first tier):\n\n" + markdown_table([{k: p[k] for k in keys} for p in points])


def _plot(fig: Any, rows: list[dict[str, Any]], sweeps: dict[str, list[dict[str, Any]]]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    for name, pts in sweeps.items():
        ax1.plot([100 * p["ratio"] for p in pts], [p["ttft_s"] * 1e3 for p in pts], marker="o", label=name)
        if pts and "kl_first" in pts[0]:
            ax2.plot([100 * p["ratio"] for p in pts], [p["kl_first"] for p in pts], marker="o", label=name)
    for name in {r["model"] for r in rows}:
        full = statistics.mean(r["ttft_s"] for r in rows if r["model"] == name and r["mode"] == "full")
        ax1.axhline(full * 1e3, linestyle="--", linewidth=1, label=f"{name} full prefill")
    ax1.set_xlabel("recompute ratio %")
    ax1.set_ylabel("TTFT ms (CPU tier)")
    ax1.set_title("TTFT vs recompute ratio")
    ax1.legend()
    ax2.set_xlabel("recompute ratio %")
    ax2.set_ylabel("first-token KL vs full prefill")
    ax2.set_title("quality vs ratio (real weights only)")
    if ax2.lines:
        ax2.legend()
