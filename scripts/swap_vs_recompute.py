"""What preempting a fused request costs: its pages swapped to host memory and back (engine/swap.py)
vs recomputing its tokens by prefill (what preemption did before, which also changed its KV).

A random-weight model of a real shape (timing does not depend on weight values), a request of
``--tokens`` tokens: the swap's round trip (out, then in to other blocks; medians, CUDA-synchronised)
against a plain prefill of the same tokens to its first token. The pages copied back are checked
equal to the originals bit for bit. Then what a copy back costs the requests running meanwhile:
two decode steps of ``--batch`` running requests with the copy queued just before them, until the
steps' own end, against the same steps alone (on CUDA the copy runs on a side stream).
Writes ``swap.json`` and ``swap.md`` under OUT.

Usage: python3 scripts/swap_vs_recompute.py OUT [--shape mistral-7b] [--tokens 3104] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ragfuse.bench.engine import Sync, median_time
from ragfuse.bench.shapes import shape_config
from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--tokens", type=int, default=3104)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=16, help="running requests during the copy back")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = shape_config(args.shape)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], max(args.tokens + 64, 8192))
    mc = ModelConfig.from_dict(cfg)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    running_tokens = 512  # each running request's prompt
    budget = mc.kv_bytes_per_token(dtype) * ((args.tokens + 64) * 3 + args.batch * (running_tokens + 64))
    # no prefix tree: each timed prefill must compute its tokens, not find the last one's blocks
    eng = LLMEngine(EngineConfig(device=args.device, kv_cache_bytes=budget, prefix_tree=False), random_weights=mc)
    device, swap, blocks = eng.device, eng.scheduler.swap, eng.blocks
    assert swap is not None, "the engine was built without swap space"
    print(f"{args.shape} on {device}: {args.tokens} tokens, swap budget {swap.budget_bytes / 2**30:.1f} GiB",
          flush=True)

    table: list[int] = []
    other: list[int] = []
    blocks.grow(table, args.tokens)
    blocks.grow(other, args.tokens)
    storage = eng.runner.kv_cache.storage
    idx = torch.tensor(table, device=device)
    storage[:, :, idx] = torch.randn_like(storage[:, :, idx])
    original = storage[:, :, idx].clone()

    def round_trip() -> None:
        assert swap.swap_out("bench", table)
        swap.swap_in("bench", other)

    def swap_out_only() -> None:
        assert swap.swap_out("bench", table)
        sync()
        swap.drop("bench")

    sync = Sync(device)
    t_round = median_time(round_trip, sync, args.repeats)
    t_out = median_time(swap_out_only, sync, args.repeats)
    exact = bool(torch.equal(storage[:, :, torch.tensor(other, device=device)], original))
    nbytes = original.numel() * original.element_size()

    gen = torch.Generator().manual_seed(0)
    running = [  # requests decoding while the copy back runs
        eng.add_request(torch.randint(3, mc.vocab_size, (running_tokens,), generator=gen).tolist(),
                        SamplingParams(max_tokens=10_000, ignore_eos=True))
        for _ in range(args.batch)
    ]
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()

    def steps() -> None:
        for _ in range(2):
            eng.step()

    def copy_back_beside_steps() -> float:
        assert swap.swap_out("bench", table)  # not timed
        sync()
        t = time.perf_counter()
        swap.swap_in("bench", other)
        steps()
        if device.type == "cuda":  # the steps' own end: the copy back may go on beside them
            torch.cuda.current_stream(device).synchronize()
        took = time.perf_counter() - t
        swap.await_arrivals()
        sync()
        return took

    t_steps = median_time(steps, sync, args.repeats)
    copy_back_beside_steps()  # warm-up
    t_beside = statistics.median(copy_back_beside_steps() for _ in range(args.repeats))
    for rid in running:
        eng.abort(rid)
    blocks.release(table)
    blocks.release(other)

    ids = torch.randint(3, mc.vocab_size, (args.tokens,), generator=gen).tolist()

    def prefill() -> None:
        eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()

    t_prefill = median_time(prefill, sync, args.repeats)
    result = {
        "shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tokens": args.tokens, "kv_bytes": nbytes, "swap_round_trip_s": t_round, "swap_out_s": t_out,
        "prefill_s": t_prefill, "recompute_over_swap": t_prefill / t_round, "swap_gb_per_s": 2 * nbytes / t_round / 1e9,
        "pages_equal_after_swap": exact, "running_requests": args.batch, "two_decode_steps_s": t_steps,
        "two_decode_steps_beside_copy_back_s": t_beside, "copy_back_s": t_round - t_out,
    }
    (args.out / "swap.json").write_text(json.dumps(result, indent=2) + "\n")
    table_md = ["| shape | tokens | KV | swap out + in | swap out | prefill (recompute) | recompute / swap | equal |",
                "|---|---|---|---|---|---|---|---|",
                f"| {args.shape} | {args.tokens} | {nbytes / 2**20:.0f} MiB | {t_round * 1e3:.1f} ms "
                f"| {t_out * 1e3:.1f} ms | {t_prefill * 1e3:.1f} ms | {t_prefill / t_round:.1f}x | {exact} |"]
    table_md += ["", "| running requests | 2 decode steps | the same, a copy back queued first | copy back alone |",
                 "|---|---|---|---|",
                 f"| {args.batch} | {t_steps * 1e3:.1f} ms | {t_beside * 1e3:.1f} ms "
                 f"| {(t_round - t_out) * 1e3:.1f} ms |"]
    (args.out / "swap.md").write_text("\n".join(table_md) + "\n")
    print("\n".join(table_md), flush=True)


if __name__ == "__main__":
    main()
