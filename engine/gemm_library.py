"""Which of PyTorch's two BLAS libraries runs a matmul of given sizes on CUDA: cuBLAS or cuBLASLt,
chosen by timing both once for those sizes.

cuBLAS's heuristics choose poorly at some row counts that are not a multiple of their tiles. On an H200,
a fused prefill's steady layers (416 rows: 15% of 6 x 512 stored tokens plus a 32-token question)
through Mistral-7B's o and down projections took 30.7 and 101.2 us with cuBLAS and 24.8 and 72.8 us with
cuBLASLt, while cuBLAS won the gate_up projection at the same rows (150 vs 161 us); at 448 rows gate_up
took 313 us with cuBLAS and 288 with cuBLASLt, twice its time at 416 or 512. No fixed rule holds across
shapes, row counts and devices, so the choice is measured: while a CUDA graph's warm-up run executes
(``cuda_graphs.capture_call``, inside ``measuring``), every product of more than ``MIN_ROWS`` rows whose
sizes have no choice yet is timed with both libraries, each call captured in a graph of its own as it
will run, its weights evicted from L2 before each timed replay (by writing a buffer of twice the L2's
size) as in a real forward, where the other layers' weights pass through L2 in between; cuBLASLt is kept
for those sizes only where it is faster by ``MARGIN``.
Later calls of those sizes, replayed from graphs or eager, use the choice; sizes never measured use
PyTorch's default (cuBLAS). Measuring happens only where a graph is captured, once per size (a prefill
bucket or a fusion capacity met for the first time, a capture that already takes tens of ms; each product
adds two captures and 16 replays, a few ms), not in eager calls: an eager prefill meets a new row count
with nearly every prompt.

The choice is applied by switching ``torch.backends.cuda.preferred_blas_library`` around the one
call. That setting is process-wide: a matmul another thread issues at that moment would go to the
same library, which changes its speed, not its result (both libraries compute the same product; their
roundings differ in the last bits).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 64  # up to here the few-row Triton kernels or cuBLAS's own small-matrix paths serve
MARGIN = 0.97  # cuBLASLt is kept where it takes at most this share of cuBLAS's time
_REPEATS = 7  # timed replays per library, alternating, median kept

_Key = tuple[int, int, int, int, torch.dtype, bool]
_chosen: dict[_Key, str] = {}  # sizes -> "cublas" or "cublaslt"
_state = threading.local()  # ``measuring`` is per thread: only the capturing thread measures


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Products run in this block measure both libraries for sizes not yet chosen (outside graph
    capture: timing synchronises)."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before
        if not before:  # the L2-evicting buffer (twice the L2) lives only while measuring
            _state.flush = None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` through the library chosen for these sizes (on CUDA, more than ``MIN_ROWS`` rows).
    ``out`` [rows, out features], contiguous: the product is written there (and returned)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows <= MIN_ROWS:
        return _product(x, weight, bias, out)
    key = (x.device.index or 0, rows, weight.shape[0], weight.shape[1], x.dtype, bias is not None)
    name = _chosen.get(key)
    if name is None:
        if not getattr(_state, "on", False) or torch.cuda.is_current_stream_capturing():
            return _product(x, weight, bias, out)
        name = _chosen[key] = _measure(x, weight, bias)
    # named even for cuBLAS: TORCH_BLAS_PREFER_CUBLASLT=1 makes cuBLASLt the process's default
    with _library(name):
        return _product(x, weight, bias, out)


def _product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear``, or the same product (the same BLAS call, ``mm``/``addmm`` of the transposed
    weight) written into ``out``, so a graph's output needs no copy into its static buffer."""
    if out is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if bias is None:
        return torch.mm(x2, weight.t(), out=out)
    return torch.addmm(bias, x2, weight.t(), out=out)


def chosen() -> dict[_Key, str]:
    """The choices made so far, by (device, rows, out features, in features, dtype, has bias)."""
    return dict(_chosen)


@contextlib.contextmanager
def _library(name: str) -> Iterator[None]:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _measure(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """"cublaslt" where it beats cuBLAS by ``MARGIN`` on this product, "cublas" otherwise, also where
    cuBLASLt refuses the product (a build or dtype without it). Each library's call is captured in a
    graph of its own and the replays are timed L2-cold, alternating: the products run from graphs, where
    some of cuBLASLt's algorithms cost more than their call did eagerly (a workspace memset before the
    product is a graph node of its own, with ~6 us of idle GPU on each side of it)."""
    flush = getattr(_state, "flush", None)
    if flush is None or flush.device != x.device:
        size = 2 * torch.cuda.get_device_properties(x.device).L2_cache_size
        flush = _state.flush = torch.empty(size, dtype=torch.uint8, device=x.device)
    try:
        with _library("cublaslt"):
            F.linear(x, weight, bias)
    except RuntimeError:  # cuBLASLt refused it (cuBLAS failing would raise again below, not be hidden)
        return "cublas"
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for name in ("cublas", "cublaslt"):
        with _library(name):
            F.linear(x, weight, bias)  # picks its algorithm outside the capture
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name], capture_error_mode="thread_local"):
                F.linear(x, weight, bias)
    times: dict[str, list[float]] = {"cublas": [], "cublaslt": []}
    for i in range(_REPEATS + 1):
        for name, taken in times.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            if i:  # the first replay of each warms up
                taken.append(start.elapsed_time(end))
    lt = statistics.median(times["cublaslt"]) <= MARGIN * statistics.median(times["cublas"])
    return "cublaslt" if lt else "cublas"
