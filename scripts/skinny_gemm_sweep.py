"""Tiles for the few-row matmul of a batched decode step: Triton tilings against cuBLAS and cuBLASLt.

Run on the GPU: ``python3 scripts/skinny_gemm_sweep.py OUT [--quick]``. For each linear layer of the
Mistral-7B and Llama-2-7B shapes and each row count, the weights are cold in L2 as in a decode step
(the timed graph cycles through copies adding up to 4 L2 sizes), every tiling is checked against a
float32 product first, and the rows go to OUT/skinny.json; kernels/NOTES.md records what was chosen.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from ragfuse.kernels.skinny_gemm_triton import skinny_gemm_triton

SHAPES = {  # name: (N, K)
    "qkv-mistral": (6144, 4096), "qkv-llama": (12288, 4096), "o": (4096, 4096),
    "gate_up-mistral": (28672, 4096), "gate_up-llama": (22016, 4096),
    "down-mistral": (4096, 14336), "down-llama": (4096, 11008), "head": (32000, 4096),
}
MORE_SHAPES = {  # --more: Llama-3-8B's head, Qwen2-7B's bias-free layers, Yi-34B
    "head-llama3": (128256, 4096),
    "o-qwen2-7b": (3584, 3584), "gate_up-qwen2-7b": (37888, 3584), "down-qwen2-7b": (3584, 18944),
    "head-qwen2-7b": (152064, 3584),
    "qkv-yi-34b": (9216, 7168), "o-yi-34b": (7168, 7168), "gate_up-yi-34b": (40960, 7168),
    "down-yi-34b": (7168, 20480), "head-yi-34b": (64000, 7168),
}
L2_BYTES = 50 * 2**20
Tiles = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, warps, stages


def copies_for(n: int, k: int) -> int:
    return max(2, -(-4 * L2_BYTES // (n * k * 2)))


def time_cold(call, ws: list[torch.Tensor]) -> float:
    """Milliseconds per call, each call on the next weight copy, by CUDA-graph replay."""
    def cycle() -> None:
        for w in ws:
            call(w)
    return float(triton.testing.do_bench_cudagraph(cycle, rep=40, return_mode="median")) / len(ws)


def first_pass(quick: bool) -> list[Tiles]:
    """(BLOCK_N, BLOCK_K, warps, stages) tried first; the best few then with other warps and stages."""
    block_ns = (32, 64, 128) if quick else (16, 32, 64, 128)
    return [(bn, bk, 4, 4) for bn, bk in itertools.product(block_ns, (64, 128, 256))]


def try_tiles(x: torch.Tensor, ws: list[torch.Tensor], ref: torch.Tensor, tiles: Tiles) -> float | None:
    """Time with ``tiles`` after checking the product; None if wrong or not fitting shared memory."""
    try:
        y = skinny_gemm_triton(x, ws[0], tiles)
        err = float(((y.float() - ref).norm() / ref.norm()).item())
        if err > 1e-2:
            print(f"{tuple(ws[0].shape)} m={x.shape[0]} {tiles}: WRONG, rel. error {err:.2e}", flush=True)
            return None
        return time_cold(functools.partial(skinny_gemm_triton, x, tiles=tiles), ws)
    except Exception as e:  # a tiling that does not fit shared memory
        print(f"{tuple(ws[0].shape)} m={x.shape[0]} {tiles}: {type(e).__name__} {str(e)[:120]}", flush=True)
        return None


def sweep_shape(n: int, k: int, ms: list[int], quick: bool, dev: torch.device) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies_for(n, k))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x.float(), ws[0].float())
        row: dict = {"n": n, "k": k, "m": m}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            row[lib] = round(time_cold(functools.partial(F.linear, x), ws), 5)
        torch.backends.cuda.preferred_blas_library("cublas")
        tried = [(t, tiles) for tiles in first_pass(quick) if (t := try_tiles(x, ws, ref, tiles)) is not None]
        tried.sort()
        more = ((4, 3), (4, 6), (8, 4)) if quick else ((4, 3), (4, 5), (4, 6), (8, 4), (8, 5))
        for _, (bn, bk, _, _) in tried[:3]:
            for warps, stages in more:
                if (t := try_tiles(x, ws, ref, (bn, bk, warps, stages))) is not None:
                    tried.append((t, (bn, bk, warps, stages)))
        tried.sort()
        row["best"] = [[round(t, 5), list(tiles)] for t, tiles in tried[:6]]
        gb = n * k * 2 / 1e6
        row["gbs"] = {"cublas": round(gb / row["cublas"], 1), "cublaslt": round(gb / row["cublaslt"], 1),
                      "triton": round(gb / tried[0][0], 1) if tried else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="fewer tile widths and stage/warp counts")
    ap.add_argument("--rows", default="4,16,32,48,64")
    ap.add_argument("--more", action="store_true", help="the other model shapes (MORE_SHAPES) instead")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    results: list[dict] = []
    for name, (n, k) in (MORE_SHAPES if args.more else SHAPES).items():
        results += [{"shape": name, **row} for row in sweep_shape(n, k, [int(r) for r in args.rows.split(",")],
                                                                    args.quick, dev)]
        (out / "skinny.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
