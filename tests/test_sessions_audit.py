"""Audit of multi-turn sessions on a tiny random Llama that speaks the default model's tokenizer and chat
template (so ``LLM.chat`` runs in milliseconds, with a KV cache of a few blocks): session turns that
must wait for room in the cache instead of failing, and a disk that fills up between two turns."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ragfuse.engine import checkpoint as ckpt

BLOCK = 8
LAYERS, HEADS, KV_HEADS, HIDDEN = 2, 4, 2, 64
HEAD_DIM = HIDDEN // HEADS
SP = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with the default model's vocabulary, tokenizer and chat template."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    source = ckpt.resolve("smollm2-135m-instruct").path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, path / name)
    return path


def chat_llm(path: Path, blocks: int = 256, **options: object) -> LLM:
    """``LLM`` over ``path`` on CPU with a KV cache of ``blocks`` blocks."""
    per_block = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * BLOCK  # float32 on CPU
    eng = LLMEngine(EngineConfig(**{"model": str(path), "device": "cpu", "block_size": BLOCK,
                                    "kv_cache_bytes": blocks * per_block, **options}))
    return LLM.from_engine(eng)


def conversation(llm: LLM, first: str, answer: str, second: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
            {"role": "user", "content": second}]


def test_a_session_turn_waits_for_room_instead_of_failing(tiny: Path) -> None:
    """A session turn that reuses stored KV takes all its cache blocks when it starts. With the cache
    held by a request running beside it (another caller's open stream), ``LLM.chat`` raised
    CacheFullError from ``_add_prefilled``, where a plain request waits in the scheduler's queue. It
    must wait for room (the stream's steps run meanwhile, its tokens unchanged) and answer as a fresh
    engine does."""
    llm = chat_llm(tiny, blocks=16)  # 128 tokens
    llm.enable_sessions()
    messages = [{"role": "user", "content": "Tell me about the old lighthouse by the harbour."}]
    first = llm.chat(messages, SP, session_id="ana")
    messages = conversation(llm, messages[0]["content"], first.text, "And who keeps it now?")
    need = -(-(len(llm.chat_ids(messages))) // BLOCK)
    ref_llm = chat_llm(tiny)
    ref = ref_llm.chat(messages, SP)
    long = list(range(1000, 1001 + (16 - need) * BLOCK))  # leaves need - 1 blocks free
    stream_params = SamplingParams(max_tokens=6, ignore_eos=True)
    stream = llm.stream(long, stream_params)
    head = next(stream)
    assert llm.engine.blocks.num_free < need
    out = llm.chat(messages, SP, session_id="ana")
    assert out.metrics["session_tokens_reused"] > 0 and out.token_ids == ref.token_ids
    rest = [o for o in stream]
    assert rest[-1].finished and rest[-1].token_ids == ref_llm.generate([long], stream_params)[0].token_ids
    assert head.token_ids == rest[-1].token_ids[:1]
    llm.engine.sessions.flush()
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and not llm.engine.has_unfinished()


def test_a_disk_that_fills_up_keeps_the_sessions_previous_turn(tiny: Path, tmp_path: Path) -> None:
    """Sessions on disk only: turn 1 is written, then the disk fills up and turn 2's copy cannot be
    written. The store deleted turn 1's files before writing turn 2's, then forgot the session: turn 3
    recomputed the whole conversation. Turn 1's files now go only once turn 2's are written, so the
    session falls back to them (turn 3 reuses turn 1's history, answers as a fresh engine does), and
    nothing raises."""
    llm = chat_llm(tiny)
    llm.enable_sessions(str(tmp_path / "sessions"), cpu_bytes=0)
    store = llm.engine.sessions
    messages = [{"role": "user", "content": "Name a river in France."}]
    first = llm.chat(messages, SP, session_id="full")
    store.flush()
    kept = store.conversation("full")
    assert store.tier_of("full") == "disk"
    store.disk.reserve_bytes = 1 << 62  # the disk's free-space check now refuses every write
    messages = conversation(llm, messages[0]["content"], first.text, "And one in Spain?")
    second = llm.chat(messages, SP, session_id="full")
    assert second.metrics["session_tokens_reused"] > 0
    store.flush()
    assert store.conversation("full") == kept and store.tier_of("full") == "disk"
    messages += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "And Italy?"}]
    third = llm.chat(messages, SP, session_id="full")
    assert third.metrics["session_tokens_reused"] == second.metrics["session_tokens_reused"]  # turn 1's
    assert third.token_ids == chat_llm(tiny).chat(messages, SP).token_ids
    store.close()


def test_several_sessions_next_turns_submitted_together_all_finish_exactly(tiny: Path) -> None:
    """Three sessions' second turns added at once on the engine (``when_room``), in a cache that holds
    one of them at a time: the later ones wait for the earlier ones' blocks, none fails, and each
    answer is the greedy answer of a fresh engine over its whole conversation."""
    llm = chat_llm(tiny, blocks=12)  # 96 tokens
    llm.enable_sessions()
    eng = llm.engine
    chats = []
    for i, topic in enumerate(("rivers", "mountains", "deserts")):
        messages = [{"role": "user", "content": f"Tell me about {topic}."}]
        first = llm.chat(messages, SP, session_id=f"s{i}")
        chats.append(conversation(llm, messages[0]["content"], first.text, "Which one is the largest?"))
    starts = [lambda i=i, m=m: llm.add_chat_request(m, SP, session_id=f"s{i}") for i, m in enumerate(chats)]
    with llm.router.lock:
        ids = [eng.when_room(start) for start in starts]
        for rid in ids:
            llm.router.track(rid)
    outs = llm.router.collect(ids)
    fresh = chat_llm(tiny)
    assert [o.token_ids for o in outs] == [fresh.chat(m, SP).token_ids for m in chats]
    assert all(o.metrics["session_tokens_reused"] > 0 for o in outs)
    with llm.router.lock:
        eng.close_turns()
    assert eng.blocks.num_free == eng.blocks.num_blocks
