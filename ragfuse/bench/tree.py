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

from .engine import Sync, int_list, median_time
from .report import machine_info, write_report
from .shapes import shape_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tree", help="two-phase attention over a shared prefix vs paged decode; tree on/off e2e")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="output folder (default bench-results/tree-DEVICE)")
    p.add_argument("--shape", action="append", default=None, help="head layouts (default llama-2-7b, mistral-7b)")
    p.add_argument("--shared", type=int_list, default=None, help="shared prefix tokens (cuda: 1K,2K,4K,8K)")
    p.add_argument("--batches", type=int_list, default=None, help="sequences (cuda: 8,16,32,64)")
    p.add_argument("--private", type=int, default=None, help="own tokens per sequence (cuda: 128)")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--e2e", action="store_true", help="also time the engine with the tree on and off")
    p.add_argument("--e2e-shape", default=None, help="engine shape (cuda: mistral-7b, cpu: tiny-llama)")
    p.add_argument("--e2e-requests", type=int, default=None)
    p.add_argument("--e2e-prefix", type=int, default=None)
    p.add_argument("--e2e-tokens", type=int, default=None, help="output tokens per request")
    p.add_argument("--repeats", type=int, default=3)
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


def op_rows(args: argparse.Namespace, device: torch.device, sync: Sync) -> list[dict[str, Any]]:
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
    rows = []
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
    return rows


def e2e_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Throughput of requests sharing a prompt prefix, prefix tree on vs off, same weights."""
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams

    cuda = device.type == "cuda"
    shape = args.e2e_shape or ("mistral-7b" if cuda else "tiny-llama")
    n = args.e2e_requests or (32 if cuda else 4)
    prefix = args.e2e_prefix or (4096 if cuda else 96)
    steps = args.e2e_tokens or (64 if cuda else 8)
    cfg = shape_config(shape)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], prefix + 256 + steps)
    mc = ModelConfig.from_dict(cfg)
    dtype = "bfloat16" if cuda else "float32"
    g = torch.Generator().manual_seed(0)
    common = torch.randint(3, mc.vocab_size, (prefix,), generator=g).tolist()
    prompts = [common + torch.randint(3, mc.vocab_size, (16 + 7 * i % 64,), generator=g).tolist() for i in range(n)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    kv_bytes = int(mc.kv_bytes_per_token(torch.bfloat16 if cuda else torch.float32) * (n + 2) * (prefix + 400))
    rows = []
    tokens: list[dict[str, list[int]]] = []
    for tree in tqdm([False, True], desc="bench tree (engine)"):
        eng = LLMEngine(EngineConfig(device=device.type, dtype=dtype, kv_cache_bytes=kv_bytes, prefix_tree=tree,
                                     max_num_seqs=max(64, n)), random_weights=mc)
        eng.add_request(prompts[0][:64], SamplingParams(max_tokens=2))  # warm-up: compiles kernels
        while eng.has_unfinished():
            eng.step()
        if eng.tree is not None:
            eng.tree.clear()
        Sync(device)()
        t0 = time.perf_counter()
        rids = [eng.add_request(p, params) for p in prompts]
        outs, first_all = [], None
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs.append(o)
            started = not eng.scheduler.waiting and all(s.output_token_ids for s in eng.scheduler.running)
            if first_all is None and started:
                first_all = time.perf_counter()
        wall = time.perf_counter() - t0
        cached = sum(o.metrics["cached_tokens"] for o in outs)
        tokens.append({rids.index(o.request_id): o.token_ids for o in outs})
        rows.append({
            "part": "e2e", "layout": shape, "tree": tree, "requests": n, "shared": prefix, "output_tokens": steps,
            "prefill_tokens": sum(map(len, prompts)) - cached, "wall_s": wall, "output_tok_s": n * steps / wall,
            "decode_s": wall - (first_all - t0) if first_all else None,
        })
        del eng
        if cuda:
            torch.cuda.empty_cache()
    off, on = rows
    on["speedup"] = off["wall_s"] / on["wall_s"]
    # bf16 sums in another order may flip a near-tie of random weights: report, do not assert
    on["same_outputs"] = sum(tokens[0][i] == tokens[1][i] for i in range(n)) / n
    return rows


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    torch.manual_seed(0)
    sync = Sync(device)
    rows = op_rows(args, device, sync)
    if args.e2e:
        rows += e2e_rows(args, device)
    results = {"benchmark": "tree", "machine": machine_info(str(device)), "page": args.page}
    notes = (
        "Decode attention of one layer: b sequences sharing s prefix tokens plus c own tokens each. paged = our "
        "split-K paged decode kernel, two_phase = chunk-first + sequence-first kernels (CUDA-graph replay medians "
        "on CUDA; torch references on CPU). kv_read_ratio = b(s+c)/(s+bc), the KV bytes the paged kernel reads per "
        "byte the two-phase one reads. e2e rows: random-weight engine, tree off vs on (two-phase decode runs "
        "eagerly, plain decode in CUDA graphs)."
    )
    path = write_report(args.out or f"bench-results/tree-{args.device}", "ragfuse bench tree", results, rows,
                        lambda fig: _plot(fig, rows), notes)
    print((path / "results.md").read_text())
    return 0


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    ops = [r for r in rows if r["part"] == "op"]
    layouts = list(dict.fromkeys(r["layout"] for r in ops))
    axes = fig.subplots(1, len(layouts), squeeze=False)[0]
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
