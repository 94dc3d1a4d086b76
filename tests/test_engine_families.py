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
    # the window on layers 1 and 2 only (from max_window_layers on): layer 0 sees the whole context
    "qwen2-sliding-window-layers": (HFQwen2, Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=12, max_window_layers=1, tie_word_embeddings=False,
    )),
    # attention_bias puts a bias on q/k/v and o_proj, mlp_bias on gate/up/down
    "llama-biases": (HFLlama, LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    cls, cfg = FAMILIES[request.param]
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    with torch.no_grad():  # random biases (transformers starts them at 0), so a loader that drops them fails
        for name, param in ref.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
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


def test_each_layer_gets_its_own_window(pair):
    """As transformers builds them: Mistral's window on every layer, Qwen2's on the layers its config
    marks, none elsewhere; relay attention (which a window would cut across) only where no layer has one."""
    name, ref, eng = pair
    # Qwen2's attention holds its layer's window; Mistral's reads the config's; Llama's config has none
    default = getattr(ref.config, "sliding_window", None)
    theirs = [getattr(layer.self_attn, "sliding_window", default) for layer in ref.model.layers]
    ours = [layer.self_attn.attn.sliding_window for layer in eng.runner.model.model.layers]
    assert ours == theirs == list(eng.model_config.layer_windows), name
    assert eng.supports_relay == all(w is None for w in ours)
