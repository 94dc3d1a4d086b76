"""Launch configs of the shipped ``cap_k_shift_triton`` (walk + cap) at the fusion graphs' shape, each timed
in a CUDA graph (median of 5 x 40 replays) and checked against the torch reference.

Usage: capsweep.py BLOCK_R,BLOCK_T,WARPS,STAGES[,SEGMENT_PROGRAMS] ...
Env: SEG_L (stored rows per segment, default 512), REAL (real question tokens of the 64, default 33).
``rel_err`` is relative to the cut the cap makes (NaN where no segment's move passes the limit)."""

import json
import os
import statistics
import sys

import torch

from ragfuse.kernels import mass_direction_triton as mdt
from ragfuse.kernels.mass_direction import cap_k_shift_ref
from ragfuse.kernels.rope import cos_sin_table, inv_frequencies

configs = [tuple(int(x) for x in (c + ",16").split(","))[:5] for c in sys.argv[1:]]
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
W, H, KVH, D, T, S = 64, 32, 8, 128, 3072, 64
seg_len, real = int(os.environ.get("SEG_L", 512)), int(os.environ.get("REAL", 33))
q = torch.randn(W, H, D, generator=g).to(torch.bfloat16).to(dev)
ok = (torch.arange(W) < real).to(dev)
k = torch.randn(T, KVH, D, generator=g).to(torch.bfloat16).to(dev)
at = (torch.arange(T) * 3 % 8192).to(dev)
segment = (torch.arange(T) // seg_len).clamp(max=S - 2)
bounds = torch.searchsorted(segment, torch.arange(S + 1)).to(dev)  # the spare (last) has no rows
cos, sin = (x.to(dev) for x in cos_sin_table(inv_frequencies(D, 1e6), 8192))
mk = torch.randn(S, KVH, D, generator=g).to(dev) * 0.3
limit = torch.tensor([0.05], device=dev)
args = (mk, q, ok, k, at, cos, sin, bounds, limit, D ** -0.5)
ref = cap_k_shift_ref(*(x.float().cpu() if torch.is_tensor(x) and x.is_floating_point() else
                        x.cpu() if torch.is_tensor(x) else x for x in args))


def replay_us(graph: torch.cuda.CUDAGraph, n: int = 40) -> float:
    """Microseconds per replay over ``n`` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


for br, bt, wp, st, sp in configs:
    mdt._BLOCK_R, mdt._BLOCK_T, mdt._WARPS, mdt._STAGES, mdt._SEGMENT_PROGRAMS = br, bt, wp, st, sp
    row = {"block_r": br, "block_t": bt, "warps": wp, "stages": st, "seg_programs": sp}
    got = mdt.cap_k_shift_triton(*args)
    row["rel_err"] = round(float((got.cpu() - ref).norm() / (ref - mk.cpu()).norm()), 5)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mdt.cap_k_shift_triton(*args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        mdt.cap_k_shift_triton(*args)
    replay_us(graph, 5)  # warm-up
    row["us"] = round(statistics.median(replay_us(graph) for _ in range(5)), 1)
    print(json.dumps(row), flush=True)
