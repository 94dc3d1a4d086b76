"""Scratch: fusion's scattered attention (Mistral-7B layout, 3104-key prompt) with its long query tiles' keys
split in shares (num_splits x min_share), timed in a CUDA graph, checked against the unsplit result."""
import functools
import json
import statistics

import torch

from ragfuse.bench.kernel_timing import D, turn_inputs
from ragfuse.kernels import paged_attention_triton as pat


def graph_us(fn, n=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / n * 1e3)
    return statistics.median(ts)


gen = torch.Generator().manual_seed(0)
orig = pat._prefill_min_share
for picked in (416, 608, 800, 1184):
    chosen = torch.randperm(2560, generator=gen)[: picked - 32].sort().values + 512
    pos = torch.cat([chosen, torch.arange(3072, 3104)]).cuda()
    k_cache, v_cache, tables, q, lens, cu, _ = turn_inputs(picked, 3104 - picked)
    base = None
    for splits, share in [(1, 2048), (2, 512), (2, 768), (2, 1024), (2, 1280), (3, 512), (3, 768), (4, 256),
                          (4, 384), (4, 512), (1, 2048)]:
        pat._prefill_min_share = lambda d, share=share: share
        fn = functools.partial(pat.paged_prefill_attention_triton, q, k_cache, v_cache, tables, lens, cu, D ** -0.5,
                               None, picked, q_positions=pos, max_seq_len=3104, num_splits=splits, pack=True)
        out, lse = fn()
        if base is None:
            base = (out.float(), lse)
        err = float((out.float() - base[0]).abs().max())
        us = graph_us(fn)
        print(json.dumps({"picked": picked, "splits": splits, "min_share": share, "us": round(us, 1),
                          "max_err": round(err, 4)}), flush=True)
    pat._prefill_min_share = orig
