"""Dispatch of the element-wise ops (RMSNorm, RoPE, SwiGLU's SiLU-and-multiply, cache fusion's
stored-KV writes and question attention), of the one-row linear layers of a batch-1 decode, and
choice of the kernel backend.

The choice is made per call from the tensor's device, so one model object runs on CPU and CUDA:
Triton on CUDA when it imports, the torch references elsewhere. ``RAGFUSE_KERNELS=torch`` forces the
references everywhere (to compare against them, or to step around a kernel).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable

import torch

from ragfuse.kernels.activation import silu_mul_ref
from ragfuse.kernels.mass_direction import cap_k_shift_ref
from ragfuse.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from ragfuse.kernels.question_attention import question_attention_ref
from ragfuse.kernels.rope import apply_rope_ref
from ragfuse.kernels.stored_kv import segment_shift_ref, write_stored_kv_ref

from . import gemm_library

KERNELS_ENV = "RAGFUSE_KERNELS"
BACKENDS = ("auto", "triton", "torch")
HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON:
    from ragfuse.kernels.activation_triton import silu_mul_triton
    from ragfuse.kernels.gemv_triton import gemv_triton
    from ragfuse.kernels.mass_direction_triton import cap_from_parts_triton, mass_parts_like, mass_parts_triton
    from ragfuse.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton
    from ragfuse.kernels.question_attention_triton import question_attention_triton
    from ragfuse.kernels.rope_triton import apply_rope_qk_triton, apply_rope_triton
    from ragfuse.kernels.skinny_gemm_triton import skinny_gemm_triton, skinny_tiles
    from ragfuse.kernels.stored_kv_triton import segment_shift_triton, write_stored_kv_triton


def resolve_backend(requested: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for ``requested`` ("auto", "triton", "torch") on ``device``.

    "auto" defers to ``RAGFUSE_KERNELS`` when set, else takes Triton on CUDA. Triton is refused off
    CUDA: compiled kernels need a GPU (the interpreter is for tests, which call kernels directly).
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown kernel backend {requested!r} (one of {', '.join(BACKENDS)})")
    if requested == "auto":
        requested = os.environ.get(KERNELS_ENV, "auto")
        if requested not in BACKENDS:
            raise ValueError(f"{KERNELS_ENV}={requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch"
    usable = device.type == "cuda" and HAVE_TRITON
    if requested == "triton" and not usable:
        raise ValueError(f"the triton backend needs CUDA and the triton package (device {device})")
    return "triton" if usable else "torch"


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda and resolve_backend("auto", x.device) == "triton"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, in_place)
    return fused_add_rms_norm_ref(x, residual, weight, eps, in_place)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``nn.Linear``'s product. Without bias, on CUDA: a single row (decode at batch 1) through the
    Triton GEMV, and 2-64 rows (batched decode) through the Triton few-row matmul where its measured
    tiles beat cuBLAS on this shape (``skinny_tiles``): both stream the weights faster than cuBLAS's
    kernels for so few rows (kernels/NOTES.md). More rows on CUDA: cuBLAS or cuBLASLt, whichever was
    measured faster for these sizes (``gemm_library``). ``out``: where the product goes (a CUDA
    graph's static buffer, which the next replay reads), written by the matmul itself where it can be."""
    if bias is None and _triton(x):
        y = None
        if x.numel() == x.shape[-1]:
            y = gemv_triton(x, weight)
        else:
            tiles = skinny_tiles(x, weight)
            if tiles is not None:
                y = skinny_gemm_triton(x, weight, tiles)
        if y is not None:
            return y if out is None else out.copy_(y)
    return gemm_library.linear(x, weight, bias, out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        return apply_rope_triton(x, positions, cos, sin)
    return apply_rope_ref(x, positions, cos, sin)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated to ``positions``: one launch on CUDA, two reference calls elsewhere."""
    if _triton(q):
        q_out, k_out = apply_rope_qk_triton(q, k, positions, cos, sin)
        assert k_out is not None
        return q_out, k_out
    return apply_rope_ref(q, positions, cos, sin), apply_rope_ref(k, positions, cos, sin)


def segment_shift(
    k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor, v_st: torch.Tensor, active_rows: torch.Tensor,
    active_segment: torch.Tensor, share: torch.Tensor, num_segments: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment stale shift of stored K/V (``kernels.stored_kv.segment_shift_ref``)."""
    fn = segment_shift_triton if _triton(k_new) else segment_shift_ref
    return fn(k_new, v_new, k_st, v_st, active_rows, active_segment, share, num_segments)


def write_stored_kv(
    k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
    shift: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stored K (before RoPE) and V shifted, rotated and written at ``slots``: one launch on CUDA
    (``kernels.stored_kv.write_stored_kv_ref``)."""
    fn = write_stored_kv_triton if _triton(k) else write_stored_kv_ref
    return fn(k, v, positions, cos, sin, *kv_cache, slots, shift, keep)


def begin_k_mass_cap(
    q: torch.Tensor, ok: torch.Tensor, k: torch.Tensor, at: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bounds: torch.Tensor, limit: torch.Tensor, scale: float,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The stale K shift's cap (``kernels.mass_direction.cap_k_shift_ref``) in two steps: this call
    starts the question's mass direction over the stored K, which needs no shift; the function it
    returns caps a K shift ``mk`` with it. On CUDA the direction's walk (~30 us a layer, few programs)
    runs on a side stream, beside what the caller launches before capping (the shift's segment means,
    ~11 us), and the capping joins it; inside a CUDA graph that is a fork and a join of the graph's
    branches. On CPU the reference needs the shift to skip segments it cannot bind, so all of it runs
    when the shift is capped."""
    if not _triton(q):
        return lambda mk: cap_k_shift_ref(mk, q, ok, k, at, cos, sin, bounds, limit, scale)
    main = torch.cuda.current_stream(q.device)
    side = _side_stream(q.device)
    # made on this stream: the side stream only writes it, and this one waits for that before reading
    # it or letting it go (so does every input the side stream reads)
    parts = mass_parts_like(q, k, bounds)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        mass_parts_triton(q, ok, k, at, cos, sin, bounds, scale, out=parts)
    group = q.shape[1] // k.shape[1]

    read = [q, k, at, cos, sin, bounds]  # held to the join: freed earlier, this stream could reuse them

    def cap(mk: torch.Tensor) -> torch.Tensor:
        main.wait_stream(side)
        read.clear()
        return cap_from_parts_triton(parts, mk, ok, limit, scale, group)

    return cap


_side = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream on ``device`` (a stream per thread: one capturing a graph puts its
    stream in that capture)."""
    streams = _side.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def question_attention(
    q: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, q_pos: torch.Tensor, n: torch.Tensor, scale: float,
    q_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The question's mean attention per prompt position (``kernels.question_attention``): two
    launches on CUDA, where the torch ops took ~20."""
    fn = question_attention_triton if _triton(q) else question_attention_ref
    return fn(q, k_cache, slots, q_pos, n, scale, q_valid)

