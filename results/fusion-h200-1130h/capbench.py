"""Kernel configs of cap_k_shift_triton at the Mistral-7B shape (64 question rows x 4, 8 KV heads, 128
dims, 6 x 512 stored rows padded to 3072, 64 segments): CUDA-event time per call, in a CUDA graph.
Usage: capbench.py MODULE BLOCK_R,BLOCK_T,WARPS ..."""
import importlib
import json
import sys

import torch

from ragfuse.kernels.mass_direction import cap_k_shift_ref
from ragfuse.kernels.rope import cos_sin_table, inv_frequencies

mdt = importlib.import_module(sys.argv[1])
configs = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]]
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
W, H, KVH, D, T, S = 64, 32, 8, 128, 3072, 64
q = torch.randn(W, H, D, generator=g).bfloat16().to(dev)
ok = (torch.arange(W) < 33).to(dev)
k = torch.randn(T, KVH, D, generator=g).bfloat16().to(dev)
at = torch.arange(T).to(dev)
seg = (torch.arange(T) // 512).to(dev)
cos, sin = (x.to(dev) for x in cos_sin_table(inv_frequencies(D, 1e6), 8192))
mk = torch.randn(S, KVH, D, generator=g).to(dev) * 0.3
mk[6:] = 0
limit = torch.tensor([0.05], device=dev)  # binds: the capped shift differs from the input
ref = cap_k_shift_ref(mk.cpu(), q.float().cpu(), ok.cpu(), k.float().cpu(), at.cpu(), cos.cpu(), sin.cpu(), seg.cpu(),
                      limit.cpu(), D ** -0.5)
out = []
for br, bt, wp in configs:
    mdt._BLOCK_R, mdt._BLOCK_T, mdt._WARPS = br, bt, wp
    try:
        got = mdt.cap_k_shift_triton(mk, q, ok, k, at, cos, sin, seg, limit, D ** -0.5)
        err = float((got.cpu() - ref).norm() / (ref - mk.cpu()).norm())  # relative to the cut itself
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mdt.cap_k_shift_triton(mk, q, ok, k, at, cos, sin, seg, limit, D ** -0.5)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            mdt.cap_k_shift_triton(mk, q, ok, k, at, cos, sin, seg, limit, D ** -0.5)
        for _ in range(5):
            graph.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        out.append({"mod": sys.argv[1], "block_r": br, "block_t": bt, "warps": wp,
                    "us": round(a.elapsed_time(b) / 50 * 1e3, 1), "rel_err": round(err, 5)})
    except Exception as exc:  # a config that does not compile
        out.append({"block_r": br, "block_t": bt, "warps": wp, "error": str(exc)[:100]})
    print(json.dumps(out[-1]), flush=True)
