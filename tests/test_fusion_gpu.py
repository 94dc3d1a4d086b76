"""Cache fusion on CUDA through the Triton kernels, against the torch references (random weights)."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV

pytestmark = pytest.mark.gpu

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "eos_token_id": 0,
}


def engine(backend: str) -> LLMEngine:
    cfg = EngineConfig(device="cuda", dtype="float32", attention_backend=backend, kv_cache_bytes=64 << 20)
    return LLMEngine(cfg, random_weights=ModelConfig.from_dict(SHAPE))


def segments(eng: LLMEngine) -> list[Segment]:
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (130, 77, 200)]
    kvs = eng.compute_kv(chunks)
    return [Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, kvs, strict=True)] + [Segment([5, 6, 7, 8, 9])]


@pytest.mark.parametrize("mode,ratio", [("full", 0.0), ("reuse", 0.0), ("fuse", 0.15), ("fuse", 1.0)])
def test_triton_fusion_matches_torch_fusion(mode, ratio):
    tri, ref = engine("triton"), engine("torch")
    assert tri.runner.attention_backend_name == "triton"
    segs_t, segs_r = segments(tri), segments(ref)
    pol = SelectionPolicy(ratio=ratio)
    lt, st = tri.score_fused(segs_t, [11, 12, 13], mode, pol)
    lr, sr = ref.score_fused(segs_r, [11, 12, 13], mode, pol)
    assert st.recomputed_tokens == sr.recomputed_tokens
    assert (lt - lr).abs().max().item() < 2e-3 * lr.abs().max().item()


def test_fuse_at_full_ratio_equals_full_prefill_on_cuda():
    eng = engine("triton")
    segs = segments(eng)
    full, _ = eng.score_fused(segs, [], "full")
    every, _ = eng.score_fused(segs, [], "fuse", SelectionPolicy(ratio=1.0))
    assert (full - every).abs().max().item() < 1e-3
