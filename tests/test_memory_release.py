"""An engine a long-running process drops is freed: the front ends that stepped it (``LLM``, a stream)
once left it reachable from a process-wide registry of step routers, so every engine ever used kept
its weights and KV cache for the life of the process (a test worker grew to 11 GB that way)."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from ragfuse.engine import LLM, LLMEngine, SamplingParams
from tests.checkpoint_helpers import save_edited, tiny_engine

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPT = list(range(1, 20))
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return save_edited(tmp_path_factory.mktemp("tiny"), HFLlama(LlamaConfig(**TINY)))


def _is_collected(ref: weakref.ref[LLMEngine]) -> bool:
    gc.collect()
    return ref() is None


def test_an_engine_that_generated_is_collected_once_dropped(checkpoint):
    engine = tiny_engine(checkpoint)
    LLM.from_engine(engine).generate([PROMPT], PARAMS)
    ref = weakref.ref(engine)
    del engine
    assert _is_collected(ref)


def test_engines_made_and_dropped_in_turn_are_all_collected(checkpoint):
    """A process that replaces its engine (a reload, a server restarted in-process) holds one at a time."""
    refs = []
    for _ in range(3):
        engine = tiny_engine(checkpoint)
        llm = LLM.from_engine(engine)
        llm.generate([PROMPT], PARAMS)
        for _out in llm.stream(PROMPT, PARAMS):
            pass
        refs.append(weakref.ref(engine))
        del engine, llm
    assert [_is_collected(r) for r in refs] == [True, True, True]


def test_an_engine_dropped_with_a_stream_left_open_is_collected_quietly(checkpoint, monkeypatch):
    """A stream left open in a reference cycle is finalised by the collector together with its engine,
    after the engine's weak references are cleared: it has nothing left to abort and must not raise (an
    exception in a finaliser is only printed, and it would hide a broken cleanup)."""
    raised: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))
    engine = tiny_engine(checkpoint)
    stream = LLM.from_engine(engine).stream(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert not next(stream).finished
    ref = weakref.ref(engine)
    cycle: list[object] = [stream]
    cycle.append(cycle)
    del engine, stream, cycle
    assert _is_collected(ref)
    assert raised == []


def test_the_connectors_shared_engine_is_one_per_resolved_device_and_freed_when_forgotten():
    """Frameworks asking for device "auto" and for the device it resolves to (LangChain's default and
    an explicit "cpu" on a CPU box) share one engine: they loaded the model twice. ``forget_shared``
    lets it go once no framework object holds it."""
    from ragfuse.app import forget_shared, shared_pipeline
    from ragfuse.engine import EngineConfig

    forget_shared()
    auto = shared_pipeline(None, device="auto").engine
    resolved = str(EngineConfig(model="smollm2-135m-instruct", device="auto").resolve_device())
    assert shared_pipeline(None, device=resolved).engine is auto
    LLM.from_engine(auto).generate([PROMPT], PARAMS)
    ref = weakref.ref(auto)
    del auto
    assert not _is_collected(ref)  # still shared
    forget_shared()
    assert _is_collected(ref)


def test_requests_left_unread_when_collecting_stops_are_ended(checkpoint):
    """An exception while the first of several requests is read (Ctrl-C, a failing ``on_finished``)
    ends the ones not read yet too: their streams had never started, so nothing aborted them, and they
    ran on unread, holding cache blocks, their outputs filed for good."""
    from ragfuse.engine.step_router import StepRouter

    engine = tiny_engine(checkpoint)
    idle = engine.blocks.num_free
    router = StepRouter.of(engine)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with router.lock:
        ids = [engine.add_request(PROMPT, PARAMS if i == 0 else long) for i in range(3)]
        for rid in ids:
            router.track(rid)

    def interrupted(_: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        router.collect(ids, on_finished=interrupted)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == idle
