"""``ragfuse bench relay``: RelayAttention against reading a shared system prompt per request.

(a) The attention op of one decode step, on the same cache data: our paged decode kernel, each
request's block table starting with the system prompt's (shared) blocks, against relay (system part
for the whole batch + context part per request, one fused reduction), next to the paper's
theoretical speedup p = (s+c+2g)/(s/b+c+7g) for g query heads per KV head.
(b) End to end, random-weight models of real shapes: output tokens/s of a batch of requests behind a
registered system prompt, with relay, with the system prompt's blocks shared but no relay, and with
no sharing (every request computes and stores the whole prompt). Request and answer lengths follow
the first turn of ShareGPT conversations (about 4 characters a token: the random models have no
tokenizer), capped by ``--max-prompt``/``--max-output``.

On CUDA the op times are medians of CUDA-graph replays; on CPU (smoke runs on tiny shapes) the torch
references are timed by wall clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ragfuse.shared_data import shared_data

from .engine import int_list
from .report import machine_info, write_report

SHAREGPT = str(shared_data("sharegpt_multiturn_dev.jsonl"))
MODES = ("none", "shared", "relay")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("relay", help="relay attention vs per-request reads of a shared system prompt")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="output folder (default bench-results/relay-DEVICE)")
    p.add_argument("--shapes", default=None, help="comma-separated shapes (default llama-2-7b,mistral-7b)")
    p.add_argument("--systems", type=int_list, default=[512, 1024, 2048, 4096, 8192], help="op: system lengths")
    p.add_argument("--contexts", type=int_list, default=[128, 256], help="op: context lengths")
    p.add_argument("--batches", type=int_list, default=[4, 8, 16, 32, 64], help="op: batch sizes")
    p.add_argument("--e2e-systems", type=int_list, default=[1024, 2048], help="end to end: system lengths")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--data", default=SHAREGPT)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-op", action="store_true")
    p.set_defaults(func=run)


def theoretical_speedup(s: int, c: int, b: int, g: int) -> float:
    """RelayAttention's IO-count speedup (the paper's eq. 10, with g query heads per KV head)."""
    return (s + c + 2 * g) / (s / b + c + 7 * g)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    return wall


def op_functions(
    heads: int, kvh: int, d: int, s: int, c: int, b: int, device: torch.device, dtype: torch.dtype
) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any], Callable[[], Any]]:
    """(paged decode over [shared system blocks + own], paged decode over [a copy of the system
    blocks per request + own], relay, the torch reference of relay): every request's own ``c``
    tokens after one system prompt of ``s`` tokens, the same K/V values in all four.

    The shared-block baseline reads the same system blocks for every request, so the GPU's L2
    cache serves part of those reads; the per-request copies are the paper's baseline (no prefix
    sharing: every read goes to DRAM)."""
    from ragfuse.engine.attention import RelayMetadata
    from ragfuse.kernels.merge import merge_attention_ref
    from ragfuse.kernels.paged_attention import paged_decode_attention_ref
    from ragfuse.kernels.relay import system_attention_ref, tile_tokens_for

    page = 16
    sys_blocks, own_blocks = -(-s // page), -(-c // page)
    blocks = sys_blocks + b * own_blocks
    k_cache = torch.randn(blocks, page, kvh, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks, device=device, dtype=torch.int32)
    sys_table = perm[:sys_blocks]
    own = perm[sys_blocks:].view(b, own_blocks)
    q = torch.randn(b, heads, d, device=device, dtype=dtype)
    scale = d**-0.5
    full_tables = torch.cat([sys_table.expand(b, -1), own], dim=1).contiguous()  # s is a multiple of the page
    full_lens = torch.full((b,), s + c, dtype=torch.int32, device=device)
    own_lens = torch.full((b,), c, dtype=torch.int32, device=device)
    copies = torch.arange(b * sys_blocks, device=device, dtype=torch.int32).view(b, sys_blocks) + blocks
    copy_tables = torch.cat([copies, own], dim=1).contiguous()
    k_copies = torch.cat([k_cache, k_cache[sys_table.long()].repeat(b, 1, 1, 1)])
    v_copies = torch.cat([v_cache, v_cache[sys_table.long()].repeat(b, 1, 1, 1)])
    relay = RelayMetadata.build([0] * b, tile_tokens_for(heads // kvh), sys_table[None].contiguous(),
                                torch.tensor([s], dtype=torch.int32, device=device), s, device)

    def ref_relay() -> Any:
        sys = system_attention_ref(q, k_cache, v_cache, relay.sys_tables, relay.sys_lens, relay.token_system, scale)
        return merge_attention_ref(*sys, *paged_decode_attention_ref(q, k_cache, v_cache, own, own_lens, scale))

    if device.type != "cuda":
        return ((lambda: paged_decode_attention_ref(q, k_cache, v_cache, full_tables, full_lens, scale)),
                (lambda: paged_decode_attention_ref(q, k_copies, v_copies, copy_tables, full_lens, scale)),
                ref_relay, ref_relay)
    from ragfuse.kernels.paged_attention_triton import paged_decode_attention_triton
    from ragfuse.kernels.relay_triton import relay_decode_attention_triton

    def paged() -> Any:
        return paged_decode_attention_triton(q, k_cache, v_cache, full_tables, full_lens, scale, max_seq_len=s + c)

    def paged_copies() -> Any:
        return paged_decode_attention_triton(q, k_copies, v_copies, copy_tables, full_lens, scale, max_seq_len=s + c)

    def relayed() -> Any:
        return relay_decode_attention_triton(q, k_cache, v_cache, own, own_lens, relay.sys_tables, relay.sys_lens,
                                             relay.tile_tokens, relay.tile_system, scale, c, s)

    return paged, paged_copies, relayed, ref_relay


def bench_op(args: argparse.Namespace, shape: str, cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = _timer(device)
    rows = []
    cases = [(s, c, b) for s in args.systems for c in args.contexts for b in args.batches]
    for s, c, b in tqdm(cases, desc=f"relay op {shape}"):
        paged, paged_copies, relayed, ref = op_functions(heads, kvh, d, s, c, b, device, dtype)
        want, got, base = ref(), relayed(), paged_copies()
        err = float((got[0].float() - want[0].float()).norm() / want[0].float().norm())
        err_base = float((base[0].float() - want[0].float()).norm() / want[0].float().norm())
        t_paged, t_copies, t_relay = timer(paged), timer(paged_copies), timer(relayed)
        p = theoretical_speedup(s, c, b, heads // kvh)
        rows.append({
            "part": "op", "shape": shape, "heads": f"{heads}q/{kvh}kv", "system": s, "context": c, "batch": b,
            "paged_shared_ms": t_paged, "paged_copies_ms": t_copies, "relay_ms": t_relay,
            "speedup": t_paged / t_relay, "speedup_vs_copies": t_copies / t_relay, "theoretical": p,
            "of_theoretical": t_paged / t_relay / p, "copies_of_theoretical": t_copies / t_relay / p,
            "rel_err": err, "rel_err_paged": err_base,
        })
        del paged, paged_copies, relayed, ref
    return rows


def workload(path: str, n: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the first ``n`` ShareGPT conversations' first turns."""
    out: list[tuple[int, int]] = []
    with open(path) as f:
        for line in f:
            turns = json.loads(line)["conversations"]
            if len(turns) < 2 or turns[0]["from"] != "human" or not turns[0]["value"].strip():
                continue
            prompt = min(max_prompt, max(4, len(turns[0]["value"]) // 4))
            answer = min(max_output, max(4, len(turns[1]["value"]) // 4))
            out.append((prompt, answer))
            if len(out) == n:
                break
    if not out:
        raise ValueError(f"{path}: no usable conversations")
    while len(out) < n:  # a short file: cycle through it
        out.append(out[len(out) % len(out)])
    return out


def run_mode(eng: Any, mode: str, system: list[int], sid: int, reqs: list[list[int]], outs: list[int],
             sync: Callable[[], None]) -> tuple[float, int]:
    """Run every request to its length; returns (seconds, output tokens)."""
    from ragfuse.engine import SamplingParams

    sync()
    t = time.perf_counter()
    for prompt, n in zip(reqs, outs):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        if mode == "none":
            eng.add_request(system + prompt, params)
        else:
            eng.add_request(prompt, params, system=sid, relay=mode == "relay")
    produced = 0
    while eng.has_unfinished():
        produced += sum(len(o.delta_token_ids) for o in eng.step())
    sync()
    return time.perf_counter() - t, produced


def bench_e2e(args: argparse.Namespace, shape: str, cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

    cfg = dict(cfg)
    need = max(args.e2e_systems) + args.max_prompt + args.max_output + 16
    cfg["max_position_embeddings"] = max(min(cfg["max_position_embeddings"], 32768), need)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    eng = LLMEngine(EngineConfig(device=device.type, dtype=dtype, max_num_seqs=args.concurrency, max_model_len=need),
                    random_weights=ModelConfig.from_dict(cfg))
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    lens = workload(args.data, args.requests, args.max_prompt, args.max_output)
    reqs = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lens]
    outs = [o for _, o in lens]
    rows = []
    for s in args.e2e_systems:
        system = torch.randint(3, vocab, (s,), generator=g).tolist()
        sid = eng.register_system(system)
        for mode in MODES:  # warm-up on the same prompts: kernels compiled before the clock runs
            run_mode(eng, mode, system, sid, reqs, [2] * len(reqs), sync)
        timed = {}
        for mode in tqdm(MODES, desc=f"relay e2e {shape} s={s}"):
            secs, tokens = run_mode(eng, mode, system, sid, reqs, outs, sync)
            timed[mode] = tokens / secs
            rows.append({"part": "e2e", "shape": shape, "system": s, "mode": mode, "requests": len(reqs),
                         "output_tokens": tokens, "seconds": secs, "tok_s": tokens / secs})
        rows.append({"part": "e2e", "shape": shape, "system": s, "mode": "relay speedup",
                     "vs_none": timed["relay"] / timed["none"], "vs_shared": timed["relay"] / timed["shared"]})
        eng.release_system(sid)
    del eng
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    from .shapes import shape_config

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    shapes = [x.strip() for x in (args.shapes or "llama-2-7b,mistral-7b").split(",") if x.strip()]
    try:
        configs = {name: shape_config(name) for name in shapes}
    except KeyError as exc:
        raise RagfuseError(str(exc.args[0])) from exc
    if not Path(args.data).is_file():
        raise RagfuseError(f"--data {args.data}: no such file")
    bad = [s for s in args.systems if s % 16]
    if bad:
        raise RagfuseError(f"--systems must be multiples of 16 (the page), got {bad}")
    torch.manual_seed(0)
    results = {"benchmark": "relay", "machine": machine_info(str(device)), "shapes": shapes,
               "goals": {"op": "speedup >= 0.9 p at b=32, s=2048, c=128 (of_theoretical, copies_of_theoretical)",
                         "e2e": "s=2048: llama-2-7b relay >= 2.2x none and >= 1.5x shared; mistral-7b >= 1.3x shared"}}
    notes = (
        f"Device: {results['machine'].get('gpu', device)}. Op rows: one decode step's attention (one layer), "
        "paged_shared = our paged decode kernel reading the shared system blocks per request (L2 serves part of "
        "those reads); paged_copies = the same kernel over a copy of the system KV per request (the paper's "
        "baseline); relay = system part once "
        "per batch + context per request + one fused reduction; theoretical = (s+c+2g)/(s/b+c+7g). "
        "E2E rows: output tokens/s, random-weight models, ShareGPT first-turn lengths."
    )
    out = args.out or f"bench-results/relay-{args.device}"
    rows: list[dict[str, Any]] = []
    for name, cfg in configs.items():
        if not args.skip_op:
            rows += bench_op(args, name, cfg, device)
    # written after each part, so a later part's failure keeps the earlier figures
    write_report(out, "ragfuse bench relay", results, rows, lambda fig: _plot(fig, rows), notes)
    if not args.skip_e2e:
        for name, cfg in configs.items():
            rows += bench_e2e(args, name, cfg, device)
            write_report(out, "ragfuse bench relay", results, rows, lambda fig, rows=rows: _plot(fig, rows), notes)
    print((Path(out) / "results.md").read_text())
    return 0


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    ops = [r for r in rows if r["part"] == "op"]
    for shape in dict.fromkeys(r["shape"] for r in ops):
        pick = [r for r in ops if r["shape"] == shape and r["context"] == min(x["context"] for x in ops)]
        batch = max(b for b in {r["batch"] for r in pick} if b <= 32)
        pick = sorted((r for r in pick if r["batch"] == batch), key=lambda r: r["system"])
        line = ax1.plot([r["system"] for r in pick], [r["speedup_vs_copies"] for r in pick], "o-",
                        label=f"{shape} vs paged, per-request copies")
        ax1.plot([r["system"] for r in pick], [r["speedup"] for r in pick], "s:", color=line[0].get_color(),
                 label=f"{shape} vs paged, shared blocks")
        ax1.plot([r["system"] for r in pick], [r["theoretical"] for r in pick], "--", color=line[0].get_color(),
                 label=f"{shape} theoretical")
        ax1.set_title(f"attention op, decode, b={batch}, c={pick[0]['context'] if pick else ''}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("system prompt tokens")
    ax1.set_ylabel("relay speedup over paged decode")
    ax1.legend(fontsize=7)
    e2e = [r for r in rows if r["part"] == "e2e" and r["mode"] == "relay speedup"]
    for shape in dict.fromkeys(r["shape"] for r in e2e):
        pick = sorted((r for r in e2e if r["shape"] == shape), key=lambda r: r["system"])
        ax2.plot([r["system"] for r in pick], [r["vs_none"] for r in pick], "o-", label=f"{shape} vs no sharing")
        ax2.plot([r["system"] for r in pick], [r["vs_shared"] for r in pick], "s--", label=f"{shape} vs prefix-shared")
    ax2.set_xlabel("system prompt tokens")
    ax2.set_ylabel("relay speedup, output tokens/s")
    ax2.set_title("end to end")
    ax2.legend(fontsize=7)
