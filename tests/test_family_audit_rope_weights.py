"""Checkpoints a user may bring whose config or weights the engine once read differently from
transformers: RoPE settings given both ways, a scaling that lacks a field, head layouts no model has,
a Mistral config without a window key, weights whose shapes disagree with the config. Each is run
against transformers' own reading of the same files, or must be refused with a ModelError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral

from ragfuse.engine.config import ModelConfig
from ragfuse.engine.errors import ModelError
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from tests.checkpoint_helpers import save_edited, tiny_engine

TINY: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
)


def _save(path: Path, cls: type, cfg: Any, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A tiny random model saved by transformers, its config.json then edited as a user might."""
    torch.manual_seed(0)
    return save_edited(path, cls(cfg), edit)


def _ids(n: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# config.json edits that transformers reads one way and the engine used to read another
EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    # transformers 5 saved rope_parameters (default); the user adds the legacy key to scale the context:
    # transformers applies it (rope_scaling replaces rope_parameters), the engine ignored it
    "rope-scaling-over-saved-parameters": lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}),
    # the replaced rope_parameters' theta is dropped with it: theta falls back to top-level / default
    "rope-scaling-replaces-parameters-theta": lambda c: c.update(
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rope_scaling={**_LLAMA3, "original_max_position_embeddings": 32},
    ),
    # llama3 scaling without original_max_position_embeddings: transformers takes max_position_embeddings
    "llama3-without-original-max": lambda c: (
        c.pop("rope_parameters"), c.update(rope_theta=500000.0, rope_scaling=dict(_LLAMA3))
    ),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_rope_settings_are_read_as_transformers_reads_them(case, tmp_path):
    path = _save(tmp_path, HFLlama, LlamaConfig(**TINY), EDITS[case])
    ids = _ids(120)  # well past 32 and 64 positions, where the scalings differ from plain RoPE
    ours = tiny_engine(path).score(ids)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4, case


@pytest.mark.parametrize(("params", "missing"), [
    ({"rope_type": "linear", "rope_theta": 10000.0}, "factor"),
    ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, "low_freq_factor"),
])
def test_rope_scaling_lacking_a_field_is_refused_not_guessed(params, missing):
    """transformers refuses these configs; the engine ran them with a default (linear with factor 1,
    i.e. no scaling at all), giving other logits than the model was trained with."""
    raw = {**LlamaConfig(**TINY).to_dict(), "rope_parameters": params}
    with pytest.raises(ModelError, match=missing):
        ModelConfig.from_dict(raw)


def test_per_layer_type_rope_parameters_are_refused():
    """transformers 5's nested form (one dict per layer type) was read as a flat dict: no rope_type
    and no rope_theta found, so it ran with theta 10000 instead of the 1e6 given."""
    per_type = {"rope_type": "default", "rope_theta": 1e6}
    raw = {**LlamaConfig(**TINY).to_dict(), "architectures": ["Qwen2ForCausalLM"],
           "rope_parameters": {"full_attention": dict(per_type), "sliding_attention": dict(per_type)}}
    with pytest.raises(ModelError, match="per-layer-type RoPE"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "message"), [
    (6, 4, 16, "not a multiple of num_key_value_heads"),
    (4, 8, 16, "not a multiple of num_key_value_heads"),
    (4, 2, 15, "odd"),
])
def test_head_layouts_no_model_has_are_refused(heads, kv_heads, head_dim, message):
    """6 query heads over 4 KV heads used to load and run (with wrong groups); transformers refuses it."""
    raw = {**LlamaConfig(**TINY).to_dict(), "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "hidden_size": 96}
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("window", ["absent", None, 12])
def test_mistral_window_follows_transformers_when_the_key_is_absent(window, tmp_path):
    """MistralConfig's default window is 4096: a config.json without ``sliding_window`` has that
    window in transformers (which matters past 4096 tokens); the engine read it as no window."""

    def edit(c: dict[str, Any]) -> None:
        if window == "absent":
            c.pop("sliding_window")
        else:
            c["sliding_window"] = window

    path = _save(tmp_path, HFMistral, MistralConfig(**TINY, sliding_window=8), edit)
    theirs = AutoConfig.from_pretrained(str(path)).sliding_window
    ours = ModelConfig.from_dir(path).layer_windows
    assert ours == (theirs,) * TINY["num_hidden_layers"]


def test_weights_disagreeing_with_the_config_are_a_model_error_naming_the_tensor(tmp_path):
    """A config with fewer KV heads than the weights used to fail with a bare torch size error."""
    path = _save(tmp_path, HFLlama, LlamaConfig(**TINY), lambda c: c.update(num_key_value_heads=1))
    with pytest.raises(ModelError, match=r"k_proj\.weight has shape \(32, 64\) but the config makes it \(16, 64\)"):
        tiny_engine(path)


def test_a_weight_that_would_broadcast_is_refused_not_copied(tmp_path):
    """A one-element norm weight used to be broadcast over the whole norm by ``copy_`` and load."""
    path = _save(tmp_path, HFLlama, LlamaConfig(**TINY))
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = torch.full((1,), 2.0)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.norm\.weight has shape \(1,\)"):
        tiny_engine(path)


def test_reuse_moves_stored_k_exactly_under_llama3_scaling(tmp_path):
    """One layer: a token's K and V there depend on the token alone, so KV computed for each chunk by
    itself and moved to the chunk's offset in the fused prompt must give full prefill's logits, with
    llama3 scaling (its low frequencies scaled, its middle ones smoothed) at positions past
    ``original_max_position_embeddings``."""
    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 1}, rope_parameters={
        **_LLAMA3, "rope_theta": 500000.0, "original_max_position_embeddings": 16})
    eng = tiny_engine(_save(tmp_path, HFLlama, cfg))
    g = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (20, 37, 41, 9)]
    kvs = eng.compute_kv(parts[:3])
    segs = [Segment(p, TensorKV(*kv)) for p, kv in zip(parts[:3], kvs, strict=True)] + [Segment(parts[3])]
    out = {}
    for mode in ("full", "reuse"):
        table: list[int] = []
        eng.blocks.grow(table, sum(map(len, parts)))
        try:
            out[mode], stats = eng.runner.fused_prefill(table, segs, mode, SelectionPolicy())
        finally:
            eng.blocks.release(table)
    assert stats.stored_tokens == 98 and stats.computed_tokens == 9
    assert (out["reuse"] - out["full"]).abs().max().item() < 1e-4
