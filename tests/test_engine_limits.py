"""Requests at the limits of the KV cache and of the request bookkeeping: none may hang the engine,
leave requests running behind the caller's back, or take an id that is in use."""

from __future__ import annotations

import pytest

from ragfuse.engine import LLM, LLMEngine, RequestError, RequestOutput, SamplingParams
from tests.test_engine_scheduling import random_engine

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def drain(engine: LLMEngine, max_steps: int = 300) -> dict[str, RequestOutput]:
    """Step until nothing is left (each request's last output); fails instead of hanging."""
    last: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return last
        last.update({o.request_id: o for o in engine.step()})
    pytest.fail(f"still unfinished after {max_steps} steps: waiting {len(engine.scheduler.waiting)}, "
                f"running {len(engine.scheduler.running)}")


@pytest.mark.parametrize("prefix_tree", [True, False])
def test_a_request_that_outgrows_the_whole_cache_ends_with_length(prefix_tree):
    """20 prompt tokens + 40 to generate in a cache of 32 tokens: once it fills the cache alone it
    is finished with 'length' and the tokens it got (those of a roomy run), the blocks all free."""
    prompt = list(range(1, 21))
    want = LLM.from_engine(random_engine(kv_blocks=400)).generate([prompt], LONG)[0].token_ids
    engine = random_engine(kv_blocks=8, prefix_tree=prefix_tree)
    free = engine.blocks.num_free
    rid = engine.add_request(prompt, LONG)
    out = drain(engine)[rid]
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == want[: len(out.token_ids)] and len(out.token_ids) == 32 - 20 + 1
    assert engine.blocks.num_free == free and not engine._seqs


def test_outgrowing_request_ends_while_a_small_one_finishes_normally():
    """Beside another request it is preempted as before; the other one finishes, then the big one
    runs alone, outgrows the cache and ends with 'length' (LLM.generate returns both)."""
    engine = random_engine(kv_blocks=10, max_num_batched_tokens=8)
    small, big = LLM.from_engine(engine).generate(
        [[5, 6, 7], list(range(1, 21))], [SamplingParams(max_tokens=6, ignore_eos=True), LONG])
    assert small.finish_reason == "length" and len(small.token_ids) == 6
    assert big.finish_reason == "length" and 0 < len(big.token_ids) < 40
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks


def test_relay_request_that_cannot_fit_beside_its_system_prompt_is_refused():
    """A relay request's own blocks plus its system prompt's must fit in the cache: refused at once."""
    engine = random_engine(kv_blocks=8)
    sid = engine.register_system(list(range(1, 21)))  # 5 blocks
    free = engine.blocks.num_free
    with pytest.raises(RequestError, match="beside its system prompt's 5 blocks"):
        engine.add_request(list(range(30, 46)), SamplingParams(max_tokens=2), system=sid)  # 4 blocks
    assert not engine.has_unfinished() and engine.blocks.num_free == free and not engine._seqs
    rid = engine.add_request(list(range(30, 41)), SamplingParams(max_tokens=2, ignore_eos=True), system=sid)
    assert len(drain(engine)[rid].token_ids) == 2  # 11 + 1 tokens: 3 blocks, the rest of the cache


@pytest.mark.parametrize("system", [False, True])
def test_a_fused_prompt_the_cache_can_never_hold_is_refused_not_waited_for(system):
    """A fused prefill takes its blocks as it starts; one larger than the whole cache (beside its relay
    system prompt) was a CacheFullError ("KV cache full ... free"), which ``when_room`` and the async
    engine wait out: it is refused at once, as a plain request is, and nothing is held."""
    from ragfuse.engine.fusion import Segment

    engine = random_engine(kv_blocks=8)
    sid = engine.register_system(list(range(1, 21))) if system else None  # 5 blocks
    free = engine.blocks.num_free
    ids = list(range(30, 46)) if system else list(range(30, 70))  # 4 blocks beside 5; 10 blocks alone
    match = "beside its system prompt's 5 blocks" if system else r"\(10 blocks\) does not fit in the KV cache of 8"
    with pytest.raises(RequestError, match=match) as info:
        engine.when_room(lambda: engine.add_fused_request([Segment(ids)], LONG, "full", system=sid))
    assert type(info.value) is RequestError
    assert not engine.has_unfinished() and engine.blocks.num_free == free and not engine._seqs


@pytest.mark.parametrize("chunk", [4, 8192])
def test_request_that_registered_system_prompts_leave_no_room_for_ends_instead_of_waiting(chunk):
    """A system prompt the application registered holds 6 of 8 blocks: a plain 3-block request can
    never start (whole, or in chunks of 4 tokens); it ends with 'length' and no tokens, and the
    request behind it is served."""
    engine = random_engine(kv_blocks=8, max_num_batched_tokens=chunk)
    engine.register_system(list(range(1, 25)))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    stuck = engine.add_request(list(range(30, 42)), sp)
    ok = engine.add_request([5, 6], sp)
    outs = drain(engine)
    assert outs[stuck].finished and outs[stuck].finish_reason == "length" and outs[stuck].token_ids == []
    assert len(outs[ok].token_ids) == 2
    assert engine.blocks.num_free == 2


def test_a_model_too_big_for_the_host_is_refused_before_it_is_allocated() -> None:
    """A model bigger than the machine's memory (a 7B shape in float32 on a 24 GiB box) was allocated
    until the kernel's OOM killer ended the process without a word; it is a ModelError naming what it
    needs. Here a 70B shape with ten times its layers (2.6 TiB in float32): more than any host has."""
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, ModelError

    shape = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 5e5}
    mc = ModelConfig.from_dict(shape)
    assert 69e9 < mc.num_params() < 72e9  # Llama-3.1-70B's published size
    huge = ModelConfig.from_dict({**shape, "num_hidden_layers": 800})
    with pytest.raises(ModelError, match=r"needs about 2\d{3}\.\d GiB of memory .* this machine has"):
        LLMEngine(EngineConfig(device="cpu", dtype="float32"), random_weights=huge)
