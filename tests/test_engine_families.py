"""Tiny random checkpoints of each supported family, saved by transformers and run by the engine."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Qwen2ForCausalLM as HFQwen2

from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams

from .test_engine_parity import hf_greedy

COMMON = dict(
    vocab_size=300, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
)

FAMILIES = {
    "llama-rope-scaling": (HFLlama, LlamaConfig(
        **COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
    "mistral-sliding-window": (HFMistral, MistralConfig(**COMMON, sliding_window=12, tie_word_embeddings=False)),
    "qwen2-qkv-bias": (HFQwen2, Qwen2Config(**COMMON, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    cls, cfg = FAMILIES[request.param]
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    if request.param == "qwen2-qkv-bias":  # random biases, so a loader that drops them fails
        with torch.no_grad():
            for layer in ref.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))
    return request.param, ref, eng


def test_all_position_logits_match(pair):
    name, ref, eng = pair
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # > window
    ours = eng.score(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4, name


def test_greedy_decode_matches(pair):
    name, ref, eng = pair
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 30)]
    outs = [o.token_ids for o in LLM.from_engine(eng).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))]
    assert outs == [hf_greedy(ref, [p], 20)[0] for p in prompts], name  # unpadded: one at a time


def test_family_is_detected(pair):
    name, _ref, eng = pair
    assert eng.model_config.family == name.split("-")[0]
    assert type(eng.runner.model).__name__.lower().startswith(eng.model_config.family)
