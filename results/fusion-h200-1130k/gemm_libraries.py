"""cuBLAS vs cuBLASLt (through a zero bias: addmm's epilogue path; and the global switch) at 384-1184 rows, Mistral-7B's
four weight shapes, weights L2-cold by cycling copies. ``bench`` is shared with gemm_triton_plain.py."""
import json
import statistics

import torch

dev = torch.device("cuda")
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
COPIES = 4


def bench(fn, n=20):
    fn(0)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(i % COPIES)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / n * 1e3)
    return statistics.median(ts)



def main() -> None:
    tot = {}
    for name, (K, N) in shapes.items():
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        zb = torch.zeros(N, device=dev, dtype=torch.bfloat16)
        for M in (384, 416, 448, 480, 512, 608, 800, 992, 1184):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "M": M}
            torch.backends.cuda.preferred_blas_library("cublas")
            row["cublas"] = round(bench(lambda i, a=a, ws=ws: torch.nn.functional.linear(a, ws[i])), 1)
            row["bias"] = round(bench(lambda i, a=a, ws=ws, zb=zb: torch.nn.functional.linear(a, ws[i], zb)), 1)
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["lt"] = round(bench(lambda i, a=a, ws=ws: torch.nn.functional.linear(a, ws[i])), 1)
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = torch.nn.functional.linear(a, ws[0])
            row["bias_eq"] = bool(torch.equal(torch.nn.functional.linear(a, ws[0], zb), ref))
            for k in ("cublas", "bias", "lt"):
                tot[(M, k)] = tot.get((M, k), 0) + row[k]
            print(json.dumps(row), flush=True)
    for M in (384, 416, 448, 480, 512, 608, 800, 992, 1184):
        print(M, {k: round(tot[(M, k)], 1) for k in ("cublas", "bias", "lt")})


if __name__ == "__main__":
    main()
