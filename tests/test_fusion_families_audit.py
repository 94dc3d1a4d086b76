"""Cache fusion with user checkpoints of other families than the default: Qwen2 (q/k/v biases, a
sliding window on some layers), Mistral (a window on every layer), Llama with llama3 RoPE scaling and
biases, and a model shallower than the shipped selection's check layers. Tiny random models saved
by transformers; the reference is the engine's plain prefill (itself checked against transformers in
test_engine_families.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.errors import RequestError
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False)
FAMILIES = {
    "qwen2-window-layers": (Qwen2ForCausalLM, lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    "mistral-window": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=16)),
    "llama3-rope-biases": (LlamaForCausalLM, lambda: LlamaConfig(
        **COMMON, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2-bias": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON)),
}


def _save(path: Path, cls: type, cfg: object) -> LLMEngine:
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases (transformers starts them at 0): a K bias that rotation mishandles shows
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> LLMEngine:
    cls, cfg = FAMILIES[request.param]
    return _save(tmp_path_factory.mktemp(request.param), cls, cfg())


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fused(engine: LLMEngine, segs: list[Segment], mode: str, policy: SelectionPolicy, system: int | None = None):
    table: list[int] = []
    engine.blocks.grow(table, sum(len(s.token_ids) for s in segs))
    try:
        logits, stats = engine.runner.fused_prefill(table, segs, mode, policy, system)
    finally:
        engine.blocks.release(table)
    return logits.log_softmax(-1), stats


def test_reuse_of_kv_computed_after_its_real_context_is_exact_past_the_window(family):
    """Each chunk's KV computed after exactly what precedes it in the prompt is full prefill's KV:
    reusing it (K stored before RoPE with its bias, re-rotated to its offset) must give full
    prefill's logits, on a prompt 5x the window, with or without relay for the prefix; fusion at
    every ratio too (the windowed layers' scattered-query attention keeps each layer's window)."""
    engine = family
    pre, c1, c2, q = _ids(12, 1), _ids(30, 2), _ids(28, 3), _ids(9, 4)
    full = engine.score(pre + c1 + c2 + q, last_n=1)[0].log_softmax(-1)
    (k1,), (k2,) = engine.compute_kv([c1], context=pre), engine.compute_kv([c2], context=pre + c1)
    segs = [Segment(pre), Segment(c1, TensorKV(*k1)), Segment(c2, TensorKV(*k2)), Segment(q)]
    for mode, ratio in (("full", 1.0), ("reuse", 0.0), ("fuse", 0.15), ("fuse", 0.5), ("fuse", 1.0)):
        got, _ = _fused(engine, segs, mode, SelectionPolicy.default().with_ratio(ratio))
        assert (got - full).abs().max().item() < 1e-4, (mode, ratio)
    if engine.supports_relay:  # no window: the prefix as a relay system prompt, the rest after it
        sid = engine.register_system(pre)
        try:
            got, _ = _fused(engine, segs[1:], "reuse", SelectionPolicy(), sid)
        finally:
            engine.release_system(sid)
        assert (got - full).abs().max().item() < 1e-4


def test_fusion_approaches_full_as_the_ratio_rises(family):
    """Chunks stored alone: reuse is approximate, fusion at ratio 1 exact, and more recompute ends
    closer to full prefill than none."""
    engine = family
    pre, chunks, q = _ids(12, 5), [_ids(30, 6), _ids(26, 7)], _ids(9, 8)
    full = engine.score(pre + sum(chunks, []) + q, last_n=1)[0].log_softmax(-1)
    segs = [Segment(pre), *(Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, engine.compute_kv(chunks),
                                                                        strict=True)), Segment(q)]

    def kl(ratio: float) -> float:
        got, _ = _fused(engine, segs, "fuse", SelectionPolicy.default().with_ratio(ratio))
        return torch.nn.functional.kl_div(got, full, log_target=True, reduction="sum").item()

    assert kl(1.0) < 1e-8
    assert kl(0.8) < kl(0.0)


@pytest.mark.parametrize("layers", [3, 4])
def test_the_ratio_holds_on_a_model_shallower_than_the_check_layers(tmp_path, layers):
    """The shipped policy checks layers 1-5, narrowing from 3r to r at layer 5. On a 4-layer model
    the checks at 4 and 5 never ran: ratio 0.3 recomputed 60% of the stored tokens (104 of 173 in
    an `ask`). Now the model's own last check layer narrows to the ratio."""
    engine = _save(tmp_path / "m", LlamaForCausalLM, LlamaConfig(**{**COMMON, "num_hidden_layers": layers}))
    pre, chunks, q = _ids(12, 9), [_ids(40, 10), _ids(40, 11)], _ids(9, 12)
    segs = [Segment(pre), *(Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, engine.compute_kv(chunks),
                                                                        strict=True)), Segment(q)]
    for ratio in (0.15, 0.3):
        _, stats = _fused(engine, segs, "fuse", SelectionPolicy.default().with_ratio(ratio))
        assert stats.recomputed_tokens == math.ceil(ratio * 80), (ratio, stats.recomputed_tokens)
        assert stats.active_per_layer[-1] == stats.recomputed_tokens + len(pre) + len(q)


def test_selective_recompute_on_a_one_layer_model_is_refused(tmp_path):
    """Layer 0 never deviates, so a one-layer model has nothing to select by: fusion at a ratio
    between 0 and 1 is an error, not a silent full recompute reported as fusion."""
    engine = _save(tmp_path / "m", LlamaForCausalLM, LlamaConfig(**{**COMMON, "num_hidden_layers": 1}))
    chunk, q = _ids(20, 13), _ids(5, 14)
    segs = [Segment(_ids(4, 15)), Segment(chunk, TensorKV(*engine.compute_kv([chunk])[0])), Segment(q)]
    with pytest.raises(RequestError, match="1 layer"):
        _fused(engine, segs, "fuse", SelectionPolicy.default().with_ratio(0.3))
    full = engine.score([t for s in segs for t in s.token_ids], last_n=1)[0].log_softmax(-1)
    got, _ = _fused(engine, segs, "fuse", SelectionPolicy.default().with_ratio(1.0))
    assert (got - full).abs().max().item() < 1e-4


def test_the_gate_does_not_fall_back_to_full_recompute_when_reuse_is_already_exact(tmp_path):
    """A Mistral whose window (4 tokens) is shorter than the question: the answer never reads the
    passages' KV, so full reuse matches full prefill up to rounding (KL ~1e-9). The gate divided
    each ratio's rounding noise by reuse's, found no ratio "closing" 60% of it (gap_closed -0.13,
    0.0, ...) and set r* = 1, full recompute for every query. Reuse's noise is no gap to close."""
    from ragfuse.gate import RATIOS, calibrate
    from ragfuse.probes import PROBES

    from .test_model_loading import tiny_tokenizer

    path = tmp_path / "m"
    cfg = MistralConfig(**{**COMMON, "vocab_size": 320, "num_hidden_layers": 2, "max_position_embeddings": 2048},
                        sliding_window=4, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).eval().save_pretrained(path)
    tiny_tokenizer(path, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))
    cal = calibrate(engine, prompts=("probes", PROBES[:1]), answer_tokens=3)
    assert cal.kl_tf_reuse < 1e-5
    assert cal.r_star == RATIOS[0] and not cal.fallback_to_full


def _short_context_mistral(path: Path, positions: int) -> LLMEngine:
    from .test_model_loading import tiny_tokenizer

    cfg = MistralConfig(**{**COMMON, "vocab_size": 320, "num_hidden_layers": 2, "max_position_embeddings": positions},
                        sliding_window=None, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).eval().save_pretrained(path)
    tiny_tokenizer(path, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))


def test_a_fused_prompt_past_the_models_context_is_a_request_error(tmp_path):
    """Callers that borrow pages themselves (the gate, evals) skip the engine's length check: a
    fused prompt past the RoPE tables failed with an IndexError inside RoPE (on CUDA a kernel would
    read past the table)."""
    engine = _short_context_mistral(tmp_path / "m", 64)
    chunk = _ids(40, 16)
    segs = [Segment(_ids(4, 17)), Segment(chunk, TensorKV(*engine.compute_kv([chunk])[0])), Segment(_ids(30, 18))]
    with engine.borrowed_blocks([[0] * 74]) as (table,), pytest.raises(RequestError, match="exceeds the context of 64"):
        engine.runner.fused_prefill(table, segs, "reuse", SelectionPolicy())


def test_a_fused_prompt_without_tokens_is_a_request_error(tmp_path):
    """Nothing to prefill (no segment, or only empty ones): a clear error, not an index error in the layout."""
    engine = _short_context_mistral(tmp_path / "m", 64)
    for segs in ([], [Segment([]), Segment([])]):
        with engine.borrowed_blocks([[0]]) as (table,), pytest.raises(RequestError, match="fused prompt is empty"):
            engine.runner.fused_prefill(table, segs, "full", SelectionPolicy())


def test_the_gate_calibrates_a_model_whose_context_is_shorter_than_its_prompts(tmp_path):
    """The calibration prompts (3.7K tokens from the shared dev sets) are longer than a 2K model's
    context: the gate crashed in RoPE on such a model's first fusion. It now drops a prompt's last
    passages until it fits."""
    from ragfuse.gate import calibrate
    from ragfuse.probes import PROBES
    from ragfuse.prompt import RagPromptBuilder

    engine = _short_context_mistral(tmp_path / "m", 400)
    builder = RagPromptBuilder(engine.tokenizer)
    probe = PROBES[0]
    whole = builder.token_ids([builder.passage_tokens(p) for p in probe["passages"]], probe["question"])
    assert len(whole) > 400  # the probe as it is does not fit
    cal = calibrate(engine, prompts=("probes", [probe]), answer_tokens=3)
    assert 0.0 < cal.r_star <= 1.0 and cal.kl_tf_reuse >= 0.0
