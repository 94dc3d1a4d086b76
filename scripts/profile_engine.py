"""Profile the engine bench's two hard cases on a CUDA device: a 4K-token prefill and a batch-1 decode step.

Usage: python3 scripts/profile_engine.py OUT_DIR [--shape mistral-7b]
Writes OUT_DIR/profile-engine.txt: the ceilings (read-only bandwidth, bf16 matmul rate), the 4K
prefill's time and its top kernels by GPU time, the matmul shapes it runs under cuBLAS and cuBLASLt,
the attention path against its old K/V expansion, and a decode step split into graph replay and
the host's share, with the step's kernels and host ops. Random weights of a real shape, as the bench.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile

from ragfuse.bench.engine import Sync, matmul_peak, read_bandwidth
from ragfuse.bench.shapes import shape_config
from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams

LINES: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    LINES.append(text)


def graph_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def kernel_table(prof, rows: int) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def gemv(x: torch.Tensor, w: torch.Tensor) -> str:
    """The engine's one-row kernel on the same shape (weights hot in L2 where they fit: 50 MB)."""
    from ragfuse.kernels.gemv_triton import gemv_tiles, gemv_triton

    n, k = w.shape
    ref = F.linear(x, w).float()
    err = ((gemv_triton(x, w).float() - ref).norm() / ref.norm()).item()
    t = graph_ms(lambda: gemv_triton(x, w))
    return f"triton {gemv_tiles(n, k)} {t:.4f} ms ({n * k * 2 / t / 1e6:.0f} GB/s, rel err {err:.1e})"


def gemms(mc: ModelConfig, tokens: int, peak: float) -> None:
    """cuBLAS against cuBLASLt (torch's preferred BLAS) on the prefill's and the decode step's shapes."""
    shapes = {
        "qkv": ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim, mc.hidden_size),
        "o": (mc.hidden_size, mc.num_heads * mc.head_dim),
        "gate_up": (2 * mc.intermediate_size, mc.hidden_size),
        "down": (mc.hidden_size, mc.intermediate_size),
        "lm_head": (mc.vocab_size, mc.hidden_size),
    }
    for m in (tokens, 1):
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = [f"M={m} {name} N={n} K={k}:"]
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                t = graph_ms(lambda x=x, w=w: F.linear(x, w))
                row.append(f"{lib} {t:.4f} ms ({2 * m * n * k / t / 1e9:.0f} TF/s, {n * k * 2 / t / 1e6:.0f} GB/s)")
            torch.backends.cuda.preferred_blas_library("cublas")
            if m == 1:
                row.append(gemv(x, w))
            say("  " + " | ".join(row))
    say(f"  (peak {peak / 1e12:.0f} TF/s)")


def attention(tokens: int, mc: ModelConfig) -> None:
    from ragfuse.engine.attention.layer import cudnn_prefill

    q = torch.randn(tokens, mc.num_heads, mc.head_dim, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(tokens, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, mc.num_kv_heads, mc.head_dim, device="cuda", dtype=torch.bfloat16)
    v = qkv[:, -mc.num_kv_heads * mc.head_dim:].view(tokens, mc.num_kv_heads, mc.head_dim)  # a strided view
    scale = mc.head_dim**-0.5
    group = mc.num_heads // mc.num_kv_heads

    def expanded():
        ke = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        ve = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(0, 1)[None], ke, ve, None, True, 0.0, True, scale=scale)[:2]
        return out[0].transpose(0, 1), lse.reshape(q.shape[1], q.shape[0]).transpose(0, 1)

    o1, l1 = cudnn_prefill(q, k, v, scale)
    o2, l2 = expanded()
    say(f"  cuDNN GQA vs expanded K/V: max |out diff| {(o1.float() - o2.float()).abs().max().item():.2e}, "
        f"max |lse diff| {(l1 - l2).abs().max().item():.2e}")
    say(f"  cudnn_prefill (GQA, engine) {graph_ms(lambda: cudnn_prefill(q, k, v, scale)):.4f} ms/layer; "
        f"with K/V expanded (before) {graph_ms(expanded):.4f} ms/layer")


def silu(tokens: int, mc: ModelConfig) -> None:
    from ragfuse.kernels.activation import silu_mul_ref
    from ragfuse.kernels.activation_triton import silu_mul_triton

    x = torch.randn(tokens, 2 * mc.intermediate_size, device="cuda", dtype=torch.bfloat16)
    err = (silu_mul_triton(x).float() - silu_mul_ref(x).float()).abs().max().item()
    say(f"  silu*up {tokens}x{mc.intermediate_size}: Triton {graph_ms(lambda: silu_mul_triton(x)):.4f} ms, "
        f"torch {graph_ms(lambda: silu_mul_ref(x)):.4f} ms/layer (max diff {err:.1e})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--parts", default="prefill,ops,decode", help="comma-separated: prefill, ops, decode")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device, sync = torch.device("cuda"), Sync(torch.device("cuda"))
    cfg = shape_config(a.shape)
    cfg["max_position_embeddings"] = a.tokens + 16
    mc = ModelConfig.from_dict(cfg)
    eng = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16",
                                 kv_cache_bytes=mc.kv_bytes_per_token(torch.bfloat16) * (a.tokens + 2048)),
                    random_weights=mc)
    peak, _ = matmul_peak(device, sync)
    bw = read_bandwidth(device, sync)
    weight_bytes = sum(t.numel() * t.element_size() for t in eng.runner.model.parameters())
    say(f"{torch.cuda.get_device_name()}: matmul peak {peak / 1e12:.0f} TF/s, read bandwidth {bw / 1e9:.0f} GB/s, "
        f"weights {weight_bytes / 1e9:.2f} GB, read bound {weight_bytes / bw * 1e3:.3f} ms")

    parts = set(a.parts.split(","))
    if "prefill" in parts:
        prefill(eng, mc, a.tokens, peak, sync)
    if "ops" in parts:
        gemms(mc, a.tokens, peak)
        attention(a.tokens, mc)
        silu(a.tokens, mc)
    if "decode" in parts:
        decode(eng, mc, a.context, weight_bytes / bw, sync)
    (out / "profile-engine.txt").write_text("\n".join(LINES) + "\n")


def prefill(eng: LLMEngine, mc: ModelConfig, tokens: int, peak: float, sync: Sync) -> None:
    say(f"\n== prefill {tokens} tokens")
    ids = torch.randint(3, mc.vocab_size, (tokens,)).tolist()
    for _ in range(2):
        eng.score(ids, last_n=1)
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        eng.score(ids, last_n=1)
        sync()
        times.append(time.perf_counter() - t)
    layer_params = sum(t.numel() for n, t in eng.runner.model.named_parameters() if ".layers." in n)
    flops = 2 * layer_params * tokens + 2 * mc.num_layers * tokens**2 * mc.num_heads * mc.head_dim
    t = statistics.median(times)
    say(f"  {t * 1e3:.1f} ms (MFU {flops / t / peak:.1%}); runs {[round(x * 1e3, 1) for x in times]}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.score(ids, last_n=1)
        sync()
    say(kernel_table(prof, 18))


def decode(eng: LLMEngine, mc: ModelConfig, context: int, bound: float, sync: Sync) -> None:
    say(f"\n== decode batch 1, context {context}")
    eng.add_request(torch.randint(3, mc.vocab_size, (context,)).tolist(), SamplingParams(max_tokens=200,
                                                                                        ignore_eos=True))
    for _ in range(8):
        eng.step()
    steps = []
    for _ in range(40):
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    graphs = eng.runner.graphs
    assert graphs is not None
    g = graphs.graphs[1].graph
    sync()
    t0 = time.perf_counter()
    for _ in range(40):
        g.replay()
    sync()
    replay = (time.perf_counter() - t0) / 40
    step = statistics.mean(steps)
    say(f"  step {step * 1e3:.3f} ms (median {statistics.median(steps) * 1e3:.3f}); graph replay alone "
        f"{replay * 1e3:.3f} ms; host and work outside the graph {(step - replay) * 1e3:.3f} ms; "
        f"bound {bound * 1e3:.3f} ms -> step/bound {step / bound:.3f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
    say(kernel_table(prof, 30))
    say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
