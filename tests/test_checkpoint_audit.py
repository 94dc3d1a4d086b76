"""Checkpoints a user may pass by path that the engine once read otherwise than transformers: a config
that ties the output head to the embedding while the weights store both (or only the head), a config
without ``max_position_embeddings``, 16-bit weights run on the CPU, and folders or configs it cannot
run, which must be refused with a ModelError that says why. Every model is a tiny random one saved by
transformers and compared with transformers' own loading of the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Qwen2ForCausalLM as HFQwen2

from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ragfuse.engine.config import ModelConfig
from ragfuse.engine.errors import ModelError

TINY: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
)
PROMPT = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def _save(path: Path, model: torch.nn.Module) -> Path:
    model.eval().save_pretrained(path)
    return path


def _edit_config(path: Path, **changes: Any) -> None:
    """Set (or, with None, drop) config.json keys, as a user or another exporter writes them."""
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    file.write_text(json.dumps(cfg))


def _edit_weights(path: Path, edit: Any) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _engine(path: Path, dtype: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype=dtype, block_size=8, kv_cache_bytes=1 << 24))


def _reference(path: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits of PROMPT and its 8 greedy tokens after it."""
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT])).logits[0].float()
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    return logits, out


def _assert_matches(path: Path) -> None:
    logits, tokens = _reference(path)
    engine = _engine(path)
    assert (engine.score(PROMPT) - logits).abs().max().item() < 1e-4
    out = LLM.from_engine(engine).generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == tokens


# ---- tied output head ------------------------------------------------------------------------------


def test_a_tied_config_whose_weights_store_another_head_runs_untied_like_transformers(tmp_path):
    """tie_word_embeddings true, but the weights hold an lm_head.weight of their own (an exporter that
    writes both, or a head fine-tuned apart): transformers finds them different and does not tie them;
    the engine skipped the stored head and served the embedding as the output head."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFQwen2(Qwen2Config(**TINY, tie_word_embeddings=True)))
    _edit_weights(path, lambda t: t.update({"lm_head.weight": torch.randn(300, 64)}))
    _assert_matches(path)


def test_a_tied_checkpoint_storing_the_head_equal_to_the_embedding_stays_tied(tmp_path):
    torch.manual_seed(0)
    path = _save(tmp_path, HFLlama(LlamaConfig(**TINY, tie_word_embeddings=True)))
    _edit_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = _engine(path).runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_tied_checkpoint_storing_only_the_head_uses_it_as_the_embedding_too(tmp_path):
    """transformers ties the other way round when the checkpoint lacks the embedding but holds the
    head; the engine refused it as missing model.embed_tokens.weight."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFLlama(LlamaConfig(**TINY, tie_word_embeddings=True)))
    _edit_weights(path, lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}))
    _assert_matches(path)


# ---- config defaults and 16-bit weights -------------------------------------------------------------


def test_llama3_scaling_without_max_position_embeddings_rotates_as_transformers(tmp_path):
    """Neither max_position_embeddings nor original_max_position_embeddings given: transformers takes
    LlamaConfig's 2048 for both; the engine took 4096, which bends other frequencies."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFLlama(LlamaConfig(**{**TINY, "max_position_embeddings": 2048})))
    _edit_config(path, max_position_embeddings=None, rope_parameters=None, rope_theta=10000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    _assert_matches(path)


@pytest.mark.parametrize("cls", [LlamaConfig, MistralConfig, Qwen2Config])
def test_a_config_without_max_position_embeddings_gets_its_family_default(cls):
    """The context a config without the key allows is the family's, as transformers reads it (4096
    capped a Mistral at 4096 of its 131072 positions)."""
    raw = {**cls(**TINY).to_dict(), "architectures": [f"{cls.__name__.removesuffix('Config')}ForCausalLM"]}
    del raw["max_position_embeddings"]
    theirs = cls.from_dict(raw).max_position_embeddings  # the config class's default
    assert ModelConfig.from_dict(raw).max_position_embeddings == theirs != 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_run_on_the_cpu_as_transformers_runs_them(tmp_path, dtype):
    """Weights saved in 16 bits: float32 by default on the CPU, exactly as transformers upcasts them,
    and in their own dtype when asked, with transformers' greedy tokens."""
    torch.manual_seed(0)
    path = _save(tmp_path, HFMistral(MistralConfig(**TINY, sliding_window=None)).to(dtype))
    _assert_matches(path)
    logits, tokens = _reference(path, dtype)
    engine = _engine(path, dtype=str(dtype).removeprefix("torch."))
    assert torch.equal(engine.score(PROMPT).argmax(-1), logits.argmax(-1))
    assert LLM.from_engine(engine).generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids \
        == tokens


# ---- refused clearly ------------------------------------------------------------------------------


@pytest.mark.parametrize(("edit", "message"), [
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "unsupported architecture.*GemmaForCausalLM"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}},
     "unsupported rope scaling 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, "'yarn' lacks factor"),
])
def test_configs_the_engine_cannot_run_are_refused_naming_why(edit, message):
    raw = {**LlamaConfig(**TINY).to_dict(), "architectures": ["LlamaForCausalLM"], **edit}
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_dict(raw)
