"""``gemm_library``: the BLAS library of a product is measured only while a graph's warm-up runs, kept per
sizes, and changes no result beyond rounding; on CPU it is plain ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragfuse.engine import gemm_library
from ragfuse.engine.cuda_graphs import capture_call


def test_cpu_products_are_f_linear_and_choose_nothing() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(300, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    before = gemm_library.chosen()
    with gemm_library.measuring():
        assert torch.equal(gemm_library.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(gemm_library.linear(x, w, None), F.linear(x, w))
    assert gemm_library.chosen() == before
    for bias in (b, None):  # into a given buffer (a graph's static output): the same values, there
        buf = torch.full((300, 40), float("nan"))
        assert gemm_library.linear(x, w, bias, out=buf) is buf
        assert torch.equal(buf, F.linear(x, w, bias))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_choice_made_at_capture_and_kept() -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    # sizes no other test uses, so the choice is this test's own
    w = (torch.randn(1200, 512, generator=g) * 0.05).to(torch.bfloat16).to(dev)
    x = torch.randn(417, 512, generator=g).to(torch.bfloat16).to(dev)
    key = (dev.index or 0, 417, 1200, 512, torch.bfloat16, False)
    ref = F.linear(x.float(), w.float())

    # outside a graph's warm-up nothing is measured, whatever the sizes
    out = gemm_library.linear(x, w, None)
    assert key not in gemm_library.chosen()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with gemm_library.measuring():  # few rows: never measured, even while measuring
        few = gemm_library.linear(x[:64], w, None)
    assert torch.equal(few, F.linear(x[:64], w))
    assert (dev.index or 0, 64, 1200, 512, torch.bfloat16, False) not in gemm_library.chosen()

    static = x.clone()
    graph, captured = capture_call(lambda: gemm_library.linear(static, w, None), (), torch.cuda.graph_pool_handle())
    choice = gemm_library.chosen()[key]  # made in the warm-up run, before capture
    assert choice in ("cublas", "cublaslt")
    static.copy_(torch.flip(x, [0]))
    graph.replay()
    torch.cuda.synchronize()
    eager = gemm_library.linear(static, w, None)  # the same library now, eagerly
    assert torch.equal(captured, eager)
    torch.testing.assert_close(captured.float(), torch.flip(ref, [0]), rtol=2e-2, atol=2e-2)
    assert gemm_library.chosen()[key] == choice  # kept, not measured again
    # written into a given buffer by the chosen library's own product: the same bits as returned
    buf = torch.full_like(eager, float("nan"))
    assert gemm_library.linear(static, w, None, out=buf) is buf
    assert torch.equal(buf, eager)
