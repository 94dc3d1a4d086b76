"""``ragfuse bench tree``: two-phase decode attention over a shared prefix vs our paged decode kernel.

Attention op, side by side on the same cache: ``b`` sequences share ``s`` prompt tokens (one set of
blocks, as the prefix tree hands out) and each has ``c`` tokens of its own. The paged kernel reads
the shared blocks once per sequence; the two-phase kernel once per batch. Head layouts of real
models (bf16 on CUDA, CUDA-graph replays timed; the torch references on CPU, for a smoke test).
End to end (``--e2e``): a random-weight engine serving requests that share a prompt prefix, with
the prefix tree on and off.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from .args import int_list, positive_int
from .engine import Sync, median_time
from .partial import Report
from .report import machine_info
from .shapes import SHAPES, shape_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tree", help="two-phase attention over a shared prefix vs paged decode; tree on/off e2e")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device to time on (cpu: a smoke run, torch references for the op)")
    p.add_argument("--out", default=None, help="output folder (default bench-results/tree-DEVICE)")
    p.add_argument("--shape", action="append", default=None, choices=SHAPES,
                   help="head layouts (default llama-2-7b, mistral-7b)")
    p.add_argument("--shared", type=int_list, default=None, help="shared prefix tokens (cuda: 1K,2K,4K,8K)")
    p.add_argument("--batches", type=int_list, default=None, help="sequences (cuda: 8,16,32,64)")
    p.add_argument("--private", type=positive_int, default=None, help="own tokens per sequence (cuda: 128)")
    p.add_argument("--page", type=positive_int, default=16, help="op: tokens per KV cache block")
    p.add_argument("--e2e", action="store_true", help="also time the engine with the tree on and off")
    p.add_argument("--e2e-shape", default=None, choices=SHAPES, help="engine shape (cuda: mistral-7b, cpu: tiny-llama)")
    p.add_argument("--e2e-requests", type=positive_int, default=None,
                   help="requests sharing the prefix (cuda: 32; cpu: 4)")
    p.add_argument("--e2e-prefix", type=positive_int, default=None,
                   help="tokens of the shared prompt prefix (cuda: 4096; cpu: 96)")
    p.add_argument("--e2e-tokens", type=positive_int, default=None, help="output tokens per request")
    p.add_argument("--repeats", type=positive_int, default=3, help="op: timed runs per kernel, the median reported")
    p.set_defaults(func=run)


def shared_cache(
    s: int, b: int, c: int, page: int, kvh: int, d: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V caches, block tables and lengths for ``b`` sequences whose first ``s`` tokens (whole
    blocks) are the same blocks; all blocks placed in random order."""
    shared_blocks, own = s // page, -(-c // page)
    num_blocks = shared_blocks + b * own
    perm = torch.randperm(num_blocks).tolist()
    path = perm[:shared_blocks]
    tables = [path + perm[shared_blocks + i * own : shared_blocks + (i + 1) * own] for i in range(b)]
    k = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    v = torch.randn(num_blocks, page, kvh, d, dtype=dtype, device=device)
    lens = torch.full((b,), shared_blocks * page + c, dtype=torch.int32, device=device)
    return k, v, torch.tensor(tables, dtype=torch.int32, device=device), lens, [path] * b


def op_rows(args: argparse.Namespace, device: torch.device, sync: Sync, rows: list[dict[str, Any]]) -> None:
    """The attention op's rows, each appended to ``rows`` as soon as it is measured."""
    from ragfuse.kernels.paged_attention import paged_decode_attention_ref
    from ragfuse.kernels.two_phase import build_two_phase_plan, two_phase_decode_ref

    cuda = device.type == "cuda"
    if cuda:
        import triton

        from ragfuse.kernels.paged_attention_triton import paged_decode_attention_triton
        from ragfuse.kernels.two_phase_triton import two_phase_decode_triton
    shapes = args.shape or ["llama-2-7b", "mistral-7b"]
    shared = args.shared or ([1024, 2048, 4096, 8192] if cuda else [64, 256])
    batches = args.batches or ([8, 16, 32, 64] if cuda else [2, 8])
    c = args.private or (128 if cuda else 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    tasks = [(name, s, b) for name in shapes for s in shared for b in batches]
    for name, s, b in tqdm(tasks, desc="bench tree (attention op)"):
        cfg = shape_config(name)
        h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or cfg["hidden_size"] // h
        k, v, tables, lens, paths = shared_cache(s, b, c, args.page, kvh, d, dtype, device)
        q = torch.randn(b, h, d, dtype=dtype, device=device)
        scale = d**-0.5
        plan = build_two_phase_plan(paths, args.page, kvh, device, group=h // kvh, head_dim=d)
        assert plan is not None
        args_ = (q, k, v, tables, lens)
        if cuda:
            paged = functools.partial(paged_decode_attention_triton, *args_, scale, max_seq_len=int(lens[0]))
            two_phase = functools.partial(two_phase_decode_triton, *args_, plan, scale)
            t_paged = triton.testing.do_bench_cudagraph(paged, rep=50, return_mode="median") / 1e3
            t_two = triton.testing.do_bench_cudagraph(two_phase, rep=50, return_mode="median") / 1e3
        else:
            paged = functools.partial(paged_decode_attention_ref, *args_, scale)
            two_phase = functools.partial(two_phase_decode_ref, *args_, plan, scale)
            t_paged = median_time(paged, sync, args.repeats)
            t_two = median_time(two_phase, sync, args.repeats)
        ref, got = paged()[0].float(), two_phase()[0].float()
        kv_bytes = 2 * kvh * d * k.element_size()
        rows.append({
            "part": "op", "layout": name, "heads": f"{h}/{kvh}x{d}", "shared": s, "private": c, "batch": b,
            "paged_us": t_paged * 1e6, "two_phase_us": t_two * 1e6, "speedup": t_paged / t_two,
            "kv_read_ratio": b * (s + c) / (s + b * c), "items": plan.num_items,
            "two_phase_gbs": (s + b * c) * kv_bytes / t_two / 1e9,
            "rel_err": float((got - ref).norm() / ref.norm()),
        })


def serve(mc: Any, dtype: str, device: torch.device, prompts: list[list[int]], steps: int, tree: bool,
          kv_bytes: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Serve ``prompts`` (``steps`` greedy tokens each) on a fresh random-weight engine, timed after
    an untimed pass over the same requests (2 tokens each), which compiles the kernels and captures
    the decode graphs (the tree's for this plan capacity too), as a serving engine has long done.
    Returns the row's timings and each request's tokens."""
    from ragfuse.engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(device=device.type, dtype=dtype, kv_cache_bytes=kv_bytes, prefix_tree=tree,
                                 max_num_seqs=max(64, len(prompts))), random_weights=mc)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    if eng.tree is not None:
        eng.tree.clear()  # the timed run computes the prefix again
    graphs = eng.runner.graphs
    replays = (graphs.replays, graphs.tree_replays) if graphs is not None else (0, 0)
    Sync(device)()
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    outs, first_all = {}, None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        started = not eng.scheduler.waiting and all(s.output_token_ids for s in eng.scheduler.running)
        if first_all is None and started:
            first_all = time.perf_counter()
    wall = time.perf_counter() - t0
    n = len(prompts)
    row = {
        "prefill_tokens": sum(map(len, prompts)) - sum(o.metrics["cached_tokens"] for o in outs.values()),
        "wall_s": wall, "output_tok_s": n * steps / wall,
        "decode_s": wall - (first_all - t0) if first_all else None,
        "graph_steps": graphs.replays - replays[0] if graphs is not None else 0,
        "tree_graph_steps": graphs.tree_replays - replays[1] if graphs is not None else 0,
    }
    del eng
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, [outs[r].token_ids for r in rids]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two runs' greedy tokens agree: whole outputs, first tokens, and the mean share of
    each output before the first difference (a flipped token changes everything after it)."""
    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))

    n = len(a)
    return {
        "same_outputs": sum(x == y for x, y in zip(a, b)) / n,
        "same_first_token": sum(x[:1] == y[:1] for x, y in zip(a, b)) / n,
        "agree_prefix": sum(common(x, y) / max(1, len(x)) for x, y in zip(a, b)) / n,
    }


def e2e_pair(shape: str, layers: int | None, dtype: str, device: torch.device, n: int, prefix: int,
             steps: int) -> list[dict[str, Any]]:
    """Requests sharing a ``prefix``-token prompt prefix, tree off vs on, same random weights."""
    from ragfuse.engine import ModelConfig

    cfg = shape_config(shape)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], prefix + 256 + steps)
    if layers:
        cfg["num_hidden_layers"] = layers
    mc = ModelConfig.from_dict(cfg)
    g = torch.Generator().manual_seed(0)
    common = torch.randint(3, mc.vocab_size, (prefix,), generator=g).tolist()
    prompts = [common + torch.randint(3, mc.vocab_size, (16 + 7 * i % 64,), generator=g).tolist() for i in range(n)]
    kv_bytes = int(mc.kv_bytes_per_token(getattr(torch, dtype)) * (n + 2) * (prefix + 400))
    rows, tokens = [], []
    for tree in (False, True):
        row, toks = serve(mc, dtype, device, prompts, steps, tree, kv_bytes)
        rows.append({"part": "e2e", "layout": shape, "layers": mc.num_layers, "dtype": dtype, "tree": tree,
                     "requests": n, "shared": prefix, "output_tokens": steps, **row})
        tokens.append(toks)
    off, on = rows
    on["speedup"] = off["wall_s"] / on["wall_s"]
    if off["decode_s"] and on["decode_s"]:
        on["decode_speedup"] = off["decode_s"] / on["decode_s"]
    on.update(agreement(*tokens))
    return rows


def e2e_rows(args: argparse.Namespace, device: torch.device, rows: list[dict[str, Any]]) -> None:
    """The timed pair (bf16 on CUDA) and, on CUDA, a float32 pair of a 4-layer cut of the same
    layout, where rounding is too small to flip a greedy token: tree on and off must agree there.
    Each pair's rows are appended to ``rows`` once both of its runs are done."""
    cuda = device.type == "cuda"
    shape = args.e2e_shape or ("mistral-7b" if cuda else "tiny-llama")
    n = args.e2e_requests or (32 if cuda else 4)
    prefix = args.e2e_prefix or (4096 if cuda else 96)
    steps = args.e2e_tokens or (64 if cuda else 8)
    specs = [(None, "bfloat16" if cuda else "float32", n, prefix, steps)]
    if cuda:
        specs.append((4, "float32", 8, 1024, 32))
    for layers, dtype, *work in tqdm(specs, desc="bench tree (engine)"):
        rows += e2e_pair(shape, layers, dtype, device, *work)


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    torch.manual_seed(0)
    sync = Sync(device)
    results = {"benchmark": "tree", "machine": machine_info(str(device)), "page": args.page}
    notes = (
        "Decode attention of one layer: b sequences sharing s prefix tokens plus c own tokens each. paged = our "
        "split-K paged decode kernel, two_phase = chunk-first + sequence-first kernels (CUDA-graph replay medians "
        "on CUDA; torch references on CPU). kv_read_ratio = b(s+c)/(s+bc), the KV bytes the paged kernel reads per "
        "byte the two-phase one reads.\n\n"
        "e2e rows: a random-weight engine serving requests that share a prompt prefix, tree off vs on, each timed "
        "after an untimed pass over the same requests (kernels compiled, graphs captured). decode_s: from the "
        "moment every request has its first token to the end; graph_steps / tree_graph_steps: decode steps "
        "replayed from CUDA graphs / of which two-phase graphs. Token agreement (on the tree-on row): "
        "same_outputs = share of requests with identical outputs, same_first_token = share with the same first "
        "token, agree_prefix = mean share of each output before its first difference. Random bf16 weights give "
        "near-flat logits whose top two often differ by less than bf16 rounding; the tree computes the same "
        "attention in another order (only the private tail is prefilled, over cached blocks; shared blocks "
        "are read once per batch and merged by log-sum-exp), so a near-tie flips and the rest of that output "
        "follows another path. The float32 pair (a 4-layer cut of the same layout, exact float32 kernels) has "
        "rounding far below the logit gaps: there the tree must not change a token."
    )
    report = Report(args.out or f"bench-results/tree-{args.device}", "ragfuse bench tree", results,
                    ["attention op", *(["engine, tree on and off"] if args.e2e else [])],
                    plot=lambda fig: _plot(fig, report.rows), notes=notes)
    with report.interruptible():
        report.begin("attention op")
        op_rows(args, device, sync, report.rows)
        if args.e2e:
            report.begin("engine, tree on and off")
            e2e_rows(args, device, report.rows)
    path = report.write()
    print((path / "results.md").read_text())
    return 0


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    ops = [r for r in rows if r["part"] == "op"]
    timed = [r for r in rows if r["part"] == "e2e"][:2]  # the timed pair comes first
    layouts = list(dict.fromkeys(r["layout"] for r in ops))
    axes = fig.subplots(1, len(layouts) + bool(timed), squeeze=False)[0]
    if timed:
        _plot_e2e(axes[-1], timed)
    for ax, name in zip(axes, layouts):
        for b in sorted({r["batch"] for r in ops}):
            pts = [r for r in ops if r["layout"] == name and r["batch"] == b]
            ax.plot([r["shared"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"b={b}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shared prefix tokens")
        ax.set_ylabel("two-phase speedup over paged decode")
        ax.set_title(name)
        ax.legend()


def _plot_e2e(ax: Any, pair: list[dict[str, Any]]) -> None:
    """Output tokens/s and decode time of the timed engine pair, tree off vs on."""
    labels = ["tree off", "tree on"]
    ax.bar([0, 1], [r["output_tok_s"] for r in pair], width=0.4, label="output tok/s", color="tab:blue")
    ax.set_xticks([0.1, 1.1], labels)
    ax.set_ylabel("output tokens/s")
    twin = ax.twinx()
    twin.bar([0.4, 1.4], [r["decode_s"] or 0.0 for r in pair], width=0.4, label="decode s", color="tab:orange")
    twin.set_ylabel("decode seconds")
    r = pair[0]
    ax.set_title(f"e2e {r['layout']} {r['dtype']}: {r['requests']} req, {r['shared']} shared")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
