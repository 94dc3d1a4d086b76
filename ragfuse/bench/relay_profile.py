"""Where relay decode's time goes on a GPU, against its bytes floor (kernels/NOTES.md records the results).

Run on the GPU machine: ``python -m ragfuse.bench.relay_profile OUT.json [--e2e]``. For each head layout
(Llama-2-7B, Mistral-7B) and a few (system, context, batch) points it times, as medians of CUDA-graph
replays with the K/V out of L2 at every call (``relay.cases``): our paged decode kernel (default and
fixed split counts), the kernel over per-request copies, relay whole, relay's parts (system programs
alone, context programs alone, the reduction alone), and relay under other launch parameters and split
counts; then the best of each parameter together, which becomes the candidate default. ``--e2e`` adds
the engine: prefill and decode step times with relay and with the prefix shared but no relay.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from .relay import _timer, cases, copy_bandwidth, cycling, rel_err, theoretical_speedup

POINTS = ((2048, 128, 32), (2048, 256, 64))  # the goal's point; a point of the end-to-end decode
LAYOUTS = {"llama-2-7b": (32, 32), "mistral-7b": (32, 8)}
ROWS: list[dict[str, Any]] = []
BEST: dict[tuple[str, int, int, int], Any] = {}  # tuning found best per point


def record(**row: Any) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def relay_variants(shape: str, heads: int, kvh: int, s: int, c: int, b: int) -> None:
    """Relay alone at one point: the default and the structural options (quick: no baselines)."""
    from ragfuse.kernels.relay_triton import DEFAULT_TUNING

    timer = _timer(torch.device("cuda"))
    shared, _ = cases(heads, kvh, 128, s, c, b, torch.device("cuda"), torch.bfloat16)
    want = shared[0].reference()
    for variant in ({}, {"fused_reduce": True, "streams": 1}, {"streams": 1}):
        tuning = replace(DEFAULT_TUNING, **variant)
        err = rel_err(shared[0].relay(tuning=tuning), want)
        record(shape=shape, s=s, c=c, b=b, what=f"relay {variant or 'default'}", rel_err=err,
               ms=timer(cycling([lambda x=x, t=tuning: x.relay(tuning=t) for x in shared])))


def profile_point(shape: str, heads: int, kvh: int, s: int, c: int, b: int, bw: float, sweep: bool) -> None:
    """Baselines, relay and its parts at one point; with ``sweep`` also relay's launch parameters."""
    from ragfuse.kernels.paged_attention_triton import reduce_splits_triton, split_buffers
    from ragfuse.kernels.relay_triton import (
        DEFAULT_TUNING,
        relay_context_splits,
        relay_partials_triton,
        relay_system_programs_per_sm,
        system_num_splits,
    )

    device, d = torch.device("cuda"), 128
    timer = _timer(device)
    shared, with_copies = cases(heads, kvh, d, s, c, b, device, torch.bfloat16)
    one = shared[0]
    want = one.reference()
    point = {"shape": shape, "s": s, "c": c, "b": b, "copies_of_data": len(shared)}
    p = theoretical_speedup(s, c, b, heads // kvh)
    t_copies = timer(cycling([x.paged_copies for x in with_copies]))
    read_rate = max(bw, one.paged_bytes / (t_copies * 1e-3))  # the paged kernel streams copies at about this
    floor = one.relay_bytes / read_rate * 1e3
    record(**point, what="floor", ms=floor, relay_mb=one.relay_bytes / 1e6, paged_mb=one.paged_bytes / 1e6,
           theoretical=p, read_gbs=read_rate / 1e9)
    record(**point, what="paged_copies", ms=t_copies)
    for splits in (None, 1, 2, 4, 8) if sweep else (None,):
        record(**point, what=f"paged_shared splits={splits}", ms=timer(cycling([
            lambda x=x, n=splits: x.paged(n) for x in shared])))

    def relay_time(label: str, **options: Any) -> float:
        try:
            err = rel_err(one.relay(**options), want)
            t = timer(cycling([lambda x=x: x.relay(**options) for x in shared]))
        except Exception as exc:  # a launch configuration that does not fit: note it, go on
            record(**point, what=label, error=repr(exc)[:200])
            return float("inf")
        record(**point, what=label, ms=t, of_floor=floor / t, vs_copies=t_copies / t,
               of_theoretical=t_copies / t / p, rel_err=err)
        return t

    base = DEFAULT_TUNING
    relay_time("relay default")
    # parts of the default launch, on the same buffers
    m = one.relay_meta
    ctx_splits = relay_context_splits(b, kvh, c, device)
    sys_splits = system_num_splits(m.tile_system.shape[0], kvh, s, device, relay_system_programs_per_sm(c))
    parts = [(x, *split_buffers(b, ctx_splits + sys_splits, heads, d, device)) for x in shared]

    def partials(only: str | None) -> Iterator[Callable[[], Any]]:
        for x, po, pl in parts:
            xm = x.relay_meta
            yield lambda x=x, xm=xm, po=po, pl=pl: relay_partials_triton(
                x.q, x.k, x.v, x.own, x.own_lens, xm.sys_tables, xm.sys_lens, xm.tile_tokens, xm.tile_system,
                x.scale, po, pl, ctx_splits, sys_splits, base, only)

    for only in (None, "system", "context"):
        record(**point, what=f"partials {only or 'both'}", ms=timer(cycling(list(partials(only)))),
               sys_splits=sys_splits, ctx_splits=ctx_splits)
    outs = [(torch.empty_like(x.q), torch.empty(b, heads, device=device)) for x in shared]
    record(**point, what="reduce only", ms=timer(cycling([
        lambda po=po, pl=pl, o=o: reduce_splits_triton(po, pl, *o) for (_, po, pl), o in zip(parts, outs)])))
    from ragfuse.kernels.paged_attention_triton import decode_partials_triton

    record(**point, what="context alone (paged decode kernel)", ms=timer(cycling([
        lambda x=x, po=po, pl=pl: decode_partials_triton(x.q, x.k, x.v, x.own, x.own_lens, x.scale, None, po, pl,
                                                         ctx_splits) for x, po, pl in parts])))
    one = {"streams": 1}  # the default runs two streams; these are one-launch variants
    for variant in ({"fused_reduce": True, **one}, one, {"fused_reduce": True, "num_stages": 3, **one},
                    {"fused_reduce": True, "num_warps": 8, **one}, {"pdl": True, **one}):
        relay_time(f"relay {variant}", tuning=replace(base, **variant))
    if not sweep:
        return
    # one parameter at a time, then the best of each together
    best: dict[str, Any] = {}
    options = {
        "pdl": [True], "half_partials": [True], "num_stages": [2, 4], "num_warps": [8],
        "sys_block_n": [128], "ctx_block_n": [32],
    }
    t0 = relay_time("relay tuned=default")
    for key, values in options.items():
        best_t = t0
        for v in values:
            t = relay_time(f"relay {key}={v}", tuning=replace(base, **{key: v}))
            if t < 0.98 * best_t:
                best[key], best_t = v, t
    tuned = replace(base, **best)
    best_split, best_t = None, relay_time(f"relay {best}", tuning=tuned)
    for sys_s in (4, 8, 16, 32):
        for ctx_s in (1, 2):
            t = relay_time(f"relay best sys_splits={sys_s} ctx_splits={ctx_s}", tuning=tuned, sys_splits=sys_s,
                           num_splits=ctx_s)
            if t < best_t:
                best_split, best_t = (sys_s, ctx_s), t
    record(**point, what="best", tuning=best, splits=best_split, ms=best_t, of_floor=floor / best_t,
           of_theoretical=t_copies / best_t / p)
    BEST[(shape, s, c, b)] = tuned
    if heads > kvh:  # GQA: one tile for the whole batch (the system K/V read once per KV head)
        for x in shared:
            x.relay_meta = x.relay_metadata(128)
        for warps in (4, 8):
            relay_time(f"relay tile_rows=128 warps={warps}", tuning=replace(tuned, num_warps=warps))
        for x in shared:
            x.relay_meta = x.relay_metadata(None)


def profile_e2e(tuning: Any) -> None:
    """Prefill and decode step times of the Mistral-7B shape behind a 2K system prompt, relay vs shared."""
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from ragfuse.kernels import relay_triton

    from .relay import SHAREGPT, workload
    from .shapes import shape_config

    cfg = shape_config("mistral-7b")
    cfg["max_position_embeddings"] = 2048 + 512 + 128 + 16
    eng = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, prefix_tree=False,
                                 max_model_len=cfg["max_position_embeddings"]),
                    random_weights=ModelConfig.from_dict(cfg))
    g = torch.Generator().manual_seed(0)
    lens = workload(SHAREGPT, 64, 512, 128)
    reqs = [torch.randint(3, 32000, (p,), generator=g).tolist() for p, _ in lens]
    sid = eng.register_system(torch.randint(3, 32000, (2048,), generator=g).tolist())
    steps: list[tuple[bool, int, float]] = []
    run = eng.runner.run

    def timed(batch: Any, *a: Any, **k: Any) -> Any:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = run(batch, *a, **k)
        torch.cuda.synchronize()
        steps.append((batch.is_prefill, len(batch), time.perf_counter() - t))
        return out

    eng.runner.run = timed
    default = relay_triton.DEFAULT_TUNING
    passes = [("shared", None), ("relay", default)] + ([("relay tuned", tuning)] if tuning is not None else [])
    for mode, tune in passes * 2:  # the first pass of each warms up
        if tune is not None and tune is not relay_triton.DEFAULT_TUNING:
            relay_triton.DEFAULT_TUNING = tune
            eng.runner.graphs.relay_graphs.clear()  # recaptured at first use with this tuning
        steps.clear()
        t = time.perf_counter()
        for prompt, (_, n) in zip(reqs, lens):
            eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), system=sid,
                            relay=mode != "shared")
        while eng.has_unfinished():
            eng.step()
        wall = time.perf_counter() - t
        pre = [x for x in steps if x[0]]
        dec = [x for x in steps if not x[0]]
        by_size: dict[int, list[float]] = {}
        for _, n, secs in dec:
            by_size.setdefault(n, []).append(secs)
        record(what=f"e2e mistral-7b s=2048 {mode}", wall_s=wall, prefill_steps=len(pre),
               prefill_s=sum(x[2] for x in pre), decode_steps=len(dec), decode_s=sum(x[2] for x in dec),
               tuning=str(tune), decode_ms_at={n: round(1e3 * sorted(v)[len(v) // 2], 3)
                                               for n, v in sorted(by_size.items()) if n in (8, 16, 32, 48, 64)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch parameters and split counts")
    parser.add_argument("--points", default=",".join(f"{s}:{c}:{b}" for s, c, b in POINTS),
                        help="system:context:batch points, comma-separated (the first is swept)")
    parser.add_argument("--variants-only", action="store_true", help="relay's structural options alone")
    parser.add_argument("--skip-op", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    bw = copy_bandwidth(_timer(device), device)
    record(what="copy bandwidth", gbs=bw / 1e9, gpu=torch.cuda.get_device_name())
    try:
        if not args.skip_op:
            for shape, (heads, kvh) in LAYOUTS.items():
                for i, (s, c, b) in enumerate(tuple(map(int, x.split(":"))) for x in args.points.split(",")):
                    if args.variants_only:
                        relay_variants(shape, heads, kvh, s, c, b)
                    else:
                        profile_point(shape, heads, kvh, s, c, b, bw, sweep=args.sweep and i == 0)
                    with open(args.out, "w") as f:
                        json.dump(ROWS, f, indent=1)
        if args.e2e:
            profile_e2e(BEST.get(("mistral-7b", 2048, 128, 32)))
    finally:
        with open(args.out, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
