"""Sweep scratch variants of the cap (mdvar) at the graphs' Mistral-7B shape, in a CUDA graph; each checked
against the torch reference. Usage: capsweep.py FUSED,BLOCK_R,BLOCK_T,WARPS,STAGES ... [--cpu-small]"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import mdvar  # noqa: E402
from ragfuse.kernels.mass_direction import cap_k_shift_ref  # noqa: E402
from ragfuse.kernels.rope import cos_sin_table, inv_frequencies  # noqa: E402

small = "--cpu-small" in sys.argv
configs = [tuple(int(x) for x in (c + ",16").split(","))[:6] for c in sys.argv[1:] if not c.startswith("--")]
dev = torch.device("cpu" if small else "cuda")
g = torch.Generator().manual_seed(0)
W, H, KVH, D, T, S, L = (8, 4, 2, int(os.environ.get("SMALL_D", 32)), 96, 8, 40) if small else (64, 32, 8, 128, 3072, 64, int(os.environ.get('SEG_L', 512)))
dt = torch.float32 if small else torch.bfloat16
q = torch.randn(W, H, D, generator=g).to(dt).to(dev)
ok = (torch.arange(W) < (5 if small else int(os.environ.get("REAL", 33)))).to(dev)
k = torch.randn(T, KVH, D, generator=g).to(dt).to(dev)
at = (torch.arange(T) * 3 % 8192).to(dev)
seg = (torch.arange(T) // L).clamp(max=S - 2)
seg = torch.searchsorted(seg, torch.arange(S + 1)).to(dev)  # bounds; the spare (last) has no rows
cos, sin = (x.to(dev) for x in cos_sin_table(inv_frequencies(D, 1e6), 8192))
mk = torch.randn(S, KVH, D, generator=g).to(dev) * 0.3
limit = torch.tensor([0.05], device=dev)
ref = cap_k_shift_ref(mk.cpu(), q.float().cpu(), ok.cpu(), k.float().cpu(), at.cpu(), cos.cpu(), sin.cpu(), seg.cpu(),
                      limit.cpu(), D ** -0.5)
for fu, br, bt, wp, st, sp in configs:
    mdvar._FUSED, mdvar._BLOCK_R, mdvar._BLOCK_T, mdvar._WARPS, mdvar._STAGES = fu, br, bt, wp, st
    mdvar.shipped._BLOCK_R, mdvar.shipped._BLOCK_T, mdvar.shipped._WARPS, mdvar.shipped._STAGES = br, bt, wp, st
    mdvar.shipped._SEGMENT_PROGRAMS = sp
    row = {"fused": fu, "block_r": br, "block_t": bt, "warps": wp, "stages": st, "seg_programs": sp}
    try:
        def call():
            fn = mdvar.shipped.cap_k_shift_triton if fu == 3 else mdvar.cap_k_shift_triton
            return fn(mk, q, ok, k, at, cos, sin, seg, limit, D ** -0.5)
        got = call()
        row["rel_err"] = round(float((got.cpu() - ref).norm() / (ref - mk.cpu()).norm()), 5)
        if not small:
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                call()
            for _ in range(5):
                graph.replay()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(40):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 40 * 1e3)
            row["us"] = round(sorted(ts)[2], 1)
    except Exception as exc:
        row["error"] = str(exc)[:160]
    print(json.dumps(row), flush=True)
