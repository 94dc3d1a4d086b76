"""Checkpoints the engine used to refuse or size wrongly: YaRN-scaled RoPE (Qwen2.5's documented long
context setup, some Llama derivatives), dynamic NTK RoPE, pickled ``pytorch_model.bin`` weights (one
file or sharded), and a tied config whose weights store a head of their own (the memory estimate
left that head out). Tiny random models, compared with transformers' own reading of the same files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen2ForCausalLM as HFQwen2

from ragfuse.engine import LLMEngine
from ragfuse.engine.checkpoint import Checkpoint, weight_files
from ragfuse.engine.config import ModelConfig, RopeConfig
from ragfuse.engine.errors import ModelError
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.engine.layers import RotaryEmbedding
from ragfuse.engine.sessions.snapshot import unrotate
from ragfuse.kernels.rope import apply_rope_ref
from tests.checkpoint_helpers import save_edited, tiny_engine, to_pickled

VOCAB = 300
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, tie_word_embeddings=False,
)
# Qwen2.5's documented long-context setting, scaled down: 64 trained positions stretched 4x
QWEN_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# every optional YaRN field set: another ramp, no truncation, DeepSeek's mscale pair
LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 64,
              "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.5, "mscale_all_dim": 0.5}


def _save(path: Path, model: torch.nn.Module, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """``model`` with random q/k/v biases (transformers starts them at 0) saved by transformers, its
    config.json then edited as a user would."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    return save_edited(path, model, edit)


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_logits_match(path: Path, n: int = 200) -> LLMEngine:
    """All-position logits of a prompt of ``n`` tokens, the engine's against transformers' loading."""
    engine = tiny_engine(path)
    ids = _ids(n)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (engine.score(ids) - theirs).abs().max().item() < 1e-4
    return engine


YARN_CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "qwen2-legacy-rope-scaling": lambda p: _save(p, HFQwen2(Qwen2Config(**TINY)), lambda c: c.update(
        rope_scaling=dict(QWEN_YARN))),
    "llama-all-fields": lambda p: _save(p, HFLlama(LlamaConfig(**TINY, rope_parameters=dict(LLAMA_YARN)))),
    "llama-attention-factor-given": lambda p: _save(p, HFLlama(LlamaConfig(**TINY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 0.75}))),
}


@pytest.fixture(scope="module", params=list(YARN_CHECKPOINTS))
def yarn_engine(request, tmp_path_factory) -> tuple[str, Path, LLMEngine]:
    torch.manual_seed(0)
    path = YARN_CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, path, tiny_engine(path)


# ---- YaRN ------------------------------------------------------------------------------------------


def test_yarn_logits_match_transformers(yarn_engine):
    """200 positions, past the 64 the ramp is set from: the engine refused rope_type yarn."""
    _name, path, _ = yarn_engine
    _assert_logits_match(path)


def test_yarn_tables_stay_pure_rotations_and_its_factor_scales_attention(yarn_engine):
    """transformers multiplies cos and sin by YaRN's attention factor; the engine keeps it out of
    its tables, so that un-rotating cached K (sessions) and rotating stored K again (fusion) give
    the K they started from, and puts its square on the attention scale instead."""
    _name, _path, engine = yarn_engine
    model = engine.runner.model
    rotary = model.model.rotary
    assert torch.allclose(rotary.cos**2 + rotary.sin**2, torch.ones_like(rotary.cos), atol=1e-6)
    k = torch.randn(50, 2, engine.model_config.head_dim, generator=torch.Generator().manual_seed(2))
    at = torch.arange(100, 150)
    assert torch.allclose(unrotate(apply_rope_ref(k, at, rotary.cos, rotary.sin), at, rotary), k, atol=1e-5)
    factor = engine.model_config.rope.attention_factor
    assert factor != 1.0
    attn = model.model.layers[0].self_attn.attn
    assert attn.scale == pytest.approx(engine.model_config.head_dim**-0.5 * factor**2)


def test_stored_kv_moved_under_yarn_matches_full_prefill(yarn_engine):
    """KV computed after its real context and reused at its offset, plain or with selective
    recompute at several ratios, gives full prefill's logits on a prompt past the original 64
    positions (mirrors the llama3 case in test_fusion_families_audit.py)."""
    _name, _path, engine = yarn_engine
    pre, c1, c2, q = _ids(20, 1), _ids(40, 2), _ids(38, 3), _ids(9, 4)
    full = engine.score(pre + c1 + c2 + q, last_n=1)[0].log_softmax(-1)
    (k1,), (k2,) = engine.compute_kv([c1], context=pre), engine.compute_kv([c2], context=pre + c1)
    segs = [Segment(pre), Segment(c1, TensorKV(*k1)), Segment(c2, TensorKV(*k2)), Segment(q)]
    for mode, ratio in (("full", 1.0), ("reuse", 0.0), ("fuse", 0.15), ("fuse", 0.5)):
        table: list[int] = []
        engine.blocks.grow(table, sum(len(s.token_ids) for s in segs))
        try:
            logits, _stats = engine.runner.fused_prefill(table, segs, mode, SelectionPolicy.default().with_ratio(ratio))
        finally:
            engine.blocks.release(table)
        assert (logits.log_softmax(-1) - full).abs().max().item() < 1e-4, (mode, ratio)


def test_one_layer_chunks_computed_alone_move_exactly_under_yarn(tmp_path):
    """One layer: a token's K and V depend on the token alone, so chunk KV computed by itself and
    moved to its offset must give full prefill's logits (the llama3 test of
    test_family_audit_rope_weights.py, with YaRN)."""
    torch.manual_seed(0)
    engine = tiny_engine(_save(tmp_path, HFQwen2(Qwen2Config(**{**TINY, "num_hidden_layers": 1})),
                           lambda c: c.update(rope_scaling=dict(QWEN_YARN))))
    g = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 37, 41, 9)]
    kvs = engine.compute_kv(parts[:3])
    segs = [Segment(p, TensorKV(*kv)) for p, kv in zip(parts[:3], kvs, strict=True)] + [Segment(parts[3])]
    out = {}
    for mode in ("full", "reuse"):
        table: list[int] = []
        engine.blocks.grow(table, sum(map(len, parts)))
        try:
            out[mode], _stats = engine.runner.fused_prefill(table, segs, mode, SelectionPolicy())
        finally:
            engine.blocks.release(table)
    assert (out["reuse"] - out["full"]).abs().max().item() < 1e-4


# ---- dynamic NTK -----------------------------------------------------------------------------------


def test_dynamic_rope_runs_as_transformers_within_max_position_embeddings(tmp_path):
    """Dynamic NTK equals plain RoPE up to max_position_embeddings, where the engine's context ends:
    it runs there with transformers' logits (it was refused)."""
    torch.manual_seed(0)
    _assert_logits_match(_save(tmp_path, HFLlama(LlamaConfig(**TINY, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}))), n=250)


def test_dynamic_rope_past_max_position_embeddings_is_refused():
    """Past it the frequencies would change with the length, which cached KV cannot follow."""
    rope = RopeConfig(scaling_type="dynamic", factor=4.0, original_max_position=256)
    with pytest.raises(ModelError, match="dynamic NTK .* past 256 positions"):
        RotaryEmbedding(16, rope, 512)


# ---- pickled weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_pickled_weights_load_as_transformers_loads_them(tmp_path, shards):
    """A folder of pytorch_model.bin weights was refused with advice to convert it."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFQwen2(Qwen2Config(**TINY)))
    to_pickled(path, shards)
    assert len(weight_files(path)) == shards
    _assert_logits_match(path, n=60)


def test_safetensors_are_preferred_over_pickled_twins(tmp_path):
    """Hub repos often hold both; transformers reads the safetensors, and only they are loaded and
    hashed into the fingerprint."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFQwen2(Qwen2Config(**TINY)))
    torch.save({"model.embed_tokens.weight": torch.zeros(VOCAB, 64)}, path / "pytorch_model.bin")
    assert weight_files(path) == [path / "model.safetensors"]
    _assert_logits_match(path, n=30)
    before = Checkpoint(name="x", path=path).fingerprint
    torch.save({"other": torch.ones(1)}, path / "pytorch_model.bin")
    assert Checkpoint(name="x", path=path).fingerprint == before


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
    "empty": lambda f: f.write_bytes(b""),
    "random-bytes": lambda f: f.write_bytes(bytes(range(256)) * 8),
    "a-list": lambda f: torch.save([torch.ones(2)], f),
    "a-non-tensor-entry": lambda f: torch.save({"model.norm.weight": torch.ones(64), "epoch": 3}, f),
    "a-pickled-object": lambda f: torch.save({"model.norm.weight": torch.ones(64), "opt": Path("/")}, f),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_pickled_weights_file_is_a_one_line_model_error_naming_it(tmp_path, damage):
    torch.manual_seed(0)
    path = _save(tmp_path, HFLlama(LlamaConfig(**TINY)))
    to_pickled(path, 1)
    DAMAGE[damage](path / "pytorch_model.bin")
    with pytest.raises(ModelError) as err:
        tiny_engine(path)
    assert str(path / "pytorch_model.bin") in str(err.value) and "\n" not in str(err.value)


# ---- memory estimate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["stores-another-head", "stores-no-head"])
def test_num_params_counts_a_stored_head_of_a_tied_config(tmp_path, head):
    """The memory estimate (num_params) counted one embedding for a tied config, but a checkpoint
    that stores a head unlike its embedding runs untied: the model holds vocab x hidden more."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    path = _save(tmp_path, HFLlama(LlamaConfig(**{**TINY, "tie_word_embeddings": True})))
    if head == "stores-another-head":
        tensors = load_file(path / "model.safetensors")
        tensors["lm_head.weight"] = torch.randn(VOCAB, 64)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = tiny_engine(path).runner.model
    held = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # biases and norms are not counted
    assert ModelConfig.from_dir(path).num_params() == held
