"""Exactness audit of the engine's shortcuts on tiny random checkpoints of families beyond the default
model: a registered system prompt's shared blocks (no relay), the prefix tree and session reuse must
give the greedy tokens of plain generation, also under cache pressure (preemption)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams

BLOCK = 8


def rnd(n: int, seed: int) -> list[int]:
    """Reproducible random token ids (the tiny checkpoints have no tokenizer)."""
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen2_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with a sliding window on its last two layers: relay attention is refused there, so a
    request behind a registered system prompt shares the prompt's blocks instead."""
    cfg = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=32, max_window_layers=1,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2-window")
    Qwen2ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def engine(path: Path, **options: object) -> LLMEngine:
    """A CPU engine over ``path`` with a small cache (16 MiB unless ``kv_cache_bytes`` says otherwise)."""
    return LLMEngine(EngineConfig(**{"model": str(path), "device": "cpu", "block_size": BLOCK,
                                     "kv_cache_bytes": 1 << 24, **options}))


def test_preempted_request_keeps_its_shared_system_blocks(qwen2_window: Path) -> None:
    """Requests behind a registered system prompt without relay hold its full blocks shared. Preempted
    under pressure, one used to give them back and prefill the system prompt again into blocks of its
    own: it then needed more blocks than it had run with and, alone, was finished "length" before its
    ``max_tokens`` (22 of 25 tokens), where the same request completes in plain generation."""
    plain = engine(qwen2_window, prefix_tree=False)
    mc = plain.model_config
    per_block = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * BLOCK  # float32 on CPU
    system, prefix = rnd(21, 5), rnd(19, 7)
    prompts = [prefix + rnd(n, n + 50) for n in (1, 5, 11, 2, 7, 3)]
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    expected = [o.token_ids for o in LLM.from_engine(plain).generate([system + p for p in prompts], params)]

    small = engine(qwen2_window, prefix_tree=False, kv_cache_bytes=12 * per_block, max_num_seqs=6,
                   max_num_batched_tokens=17)
    assert not small.supports_relay
    sid = small.register_system(system)
    free = small.blocks.num_free
    outs = LLM.from_engine(small).generate(prompts, params, system=sid)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [len(o.token_ids) for o in outs] == [25] * len(prompts)
    assert [o.token_ids for o in outs] == expected
    assert small.blocks.num_free == free  # every shared reference dropped again


ONE_LAYER = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                 max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama3-rope-gqa8", "mistral-window"])
def one_layer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer: its K/V depend on each token and its position only, never on the other tokens, so
    a session whose stored rows were cut and re-rotated must give *exactly* the tokens of a fresh
    prefill of the kept tokens (with more layers the kept rows still saw the cut ones)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    if request.param == "mistral-window":
        model = MistralForCausalLM(MistralConfig(**ONE_LAYER, num_key_value_heads=2, sliding_window=16))
    else:  # GQA 8:1, head_dim != hidden / heads, llama3 scaling that bends positions past 32
        model = LlamaForCausalLM(LlamaConfig(
            **ONE_LAYER, num_key_value_heads=1, head_dim=16, attention_bias=True,
            rope_scaling={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        ))
    torch.manual_seed(0)
    model = model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_truncated_session_turns_put_kept_rows_at_contiguous_positions(one_layer: Path, where: str, tmp_path) -> None:
    """Turns of a session overflowing a 64-token context: each turn after the first reuses stored rows
    (cut directly, then re-rotated) and must answer exactly as a fresh engine given the kept tokens."""
    from ragfuse.engine.sessions import SessionStore

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eng = engine(one_layer, prefix_tree=True, max_model_len=64)
    eng.enable_sessions(SessionStore(tmp_path, eng.fingerprint, eng.dtype, (1 << 30) if where == "cpu" else 0, 1 << 30))
    fresh = LLM.from_engine(engine(one_layer, prefix_tree=False))
    conversation, cut = rnd(20, 1), 0
    for t in range(4):
        turn = eng.begin_session_turn("s", conversation, params.max_tokens,
                                      new_tokens=len(conversation) if t == 0 else 7, keep_first=4)
        kept = turn.plan.token_ids
        out = LLM.from_engine(eng)._collect(lambda turn=turn: [eng.start_session_turn(turn, params)])[0]
        assert out.token_ids == fresh.generate([kept], params)[0].token_ids, t
        assert out.metrics["session_tokens_reused"] == (0 if t == 0 else turn.reused) and (t == 0 or turn.reused)
        cut = out.metrics["session_truncated_tokens"]
        conversation = conversation + out.token_ids + rnd(7, 10 + t)
        eng.sessions.flush()
    assert cut > 20  # the later turns did overflow and cut
