"""What preempting a fused request costs: its pages swapped to host memory and back (engine/swap.py)
vs recomputing its tokens by prefill (what preemption did before, which also changed its KV).

A random-weight model of a real shape (timing does not depend on weight values), a request of
``--tokens`` tokens: the swap's round trip (out, then in to other blocks; medians, CUDA-synchronised)
against a plain prefill of the same tokens to its first token. The pages copied back are checked
equal to the originals bit for bit. Writes ``swap.json`` and ``swap.md`` under OUT.

Usage: python3 scripts/swap_vs_recompute.py OUT [--shape mistral-7b] [--tokens 3104] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
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
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = shape_config(args.shape)
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], max(args.tokens + 64, 8192))
    mc = ModelConfig.from_dict(cfg)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    budget = mc.kv_bytes_per_token(dtype) * (args.tokens + 64) * 3
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
    blocks.release(table)
    blocks.release(other)

    ids = torch.randint(3, mc.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill() -> None:
        eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()

    t_prefill = median_time(prefill, sync, args.repeats)
    result = {
        "shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tokens": args.tokens, "kv_bytes": nbytes, "swap_round_trip_s": t_round, "swap_out_s": t_out,
        "prefill_s": t_prefill, "recompute_over_swap": t_prefill / t_round, "swap_gb_per_s": 2 * nbytes / t_round / 1e9,
        "pages_equal_after_swap": exact,
    }
    (args.out / "swap.json").write_text(json.dumps(result, indent=2) + "\n")
    table_md = ["| shape | tokens | KV | swap out + in | swap out | prefill (recompute) | recompute / swap | equal |",
                "|---|---|---|---|---|---|---|---|",
                f"| {args.shape} | {args.tokens} | {nbytes / 2**20:.0f} MiB | {t_round * 1e3:.1f} ms "
                f"| {t_out * 1e3:.1f} ms | {t_prefill * 1e3:.1f} ms | {t_prefill / t_round:.1f}x | {exact} |"]
    (args.out / "swap.md").write_text("\n".join(table_md) + "\n")
    print("\n".join(table_md), flush=True)


if __name__ == "__main__":
    main()
