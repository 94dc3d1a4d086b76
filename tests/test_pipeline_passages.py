"""Answering from passages the caller brings (what the framework connectors use): stored chunks, by id or
by text, bring their KV; text that is not stored is prefilled; chunks in flattened text are found again."""

from __future__ import annotations

import pytest

from ragfuse.engine import SamplingParams
from ragfuse.engine.errors import RequestError
from ragfuse.pipeline import Passage, final
from tests.store_helpers import ingest_demo

QUESTION = "When was the Hollowpoint lighthouse electrified?"
UNSTORED = "The Hollowpoint lighthouse was electrified in 1952 after the war, its keepers said."


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, engine):
    from ragfuse.app import open_pipeline

    pipe = open_pipeline(str(ingest_demo(tmp_path_factory.mktemp("store"), engine)), engine=engine, gate=False)
    # the instruction prefix registered for relay before the tests compare answers' reuse: the question
    # that registers it computes its KV and counts it as computed, the ones after it as reused
    pipe.ask(QUESTION, mode="fuse", ratio=0.3, top_k=1, params=SamplingParams(max_tokens=1))
    return pipe


def test_given_passages_match_retrieval_and_reuse_their_kv(pipeline):
    params = SamplingParams(max_tokens=12)
    asked = pipeline.ask(QUESTION, mode="fuse", ratio=0.3, top_k=2, params=params)
    by_id = [Passage(id=s["id"]) for s in asked.sources]
    by_text = [Passage(s["text"]) for s in asked.sources]
    for passages in (by_id, by_text):
        got = final(pipeline.stream_passages(QUESTION, passages, mode="fuse", ratio=0.3, params=params))
        assert got.answer == asked.answer and got.prompt_tokens == asked.prompt_tokens
        assert got.reused_tokens == asked.reused_tokens > len(pipeline.builder.prefix)
        assert all(s["stored"] for s in got.sources)
    assert got.sources[0]["id"] is None and got.sources[0]["text"] == asked.sources[0]["text"]


def test_unstored_text_is_prefilled_not_stored(pipeline):
    params = SamplingParams(max_tokens=16)
    keys_before = len(list(pipeline.store.kv.tiers[-1].entry_keys()))
    got = final(pipeline.stream_passages(QUESTION, [Passage(UNSTORED)], mode="reuse", params=params))
    assert got.sources == [{"text": UNSTORED, "id": None, "source": "", "score": None, "stored": False}]
    assert got.reused_tokens == len(pipeline.builder.prefix)  # the instruction prefix only
    assert "1952" in got.answer
    assert len(list(pipeline.store.kv.tiers[-1].entry_keys())) == keys_before  # the caller's text is not kept


def test_parts_with_chunks_found_in_flattened_text(pipeline):
    from ragfuse.passage_finder import PassageFinder

    hit = pipeline.retriever.search(QUESTION, 1)[0]
    text = f"Context:\n{hit.text}\n\n{UNSTORED}\n\nQuestion: {QUESTION}"
    parts = PassageFinder(pipeline.store).split(text)
    assert parts == ["Context:\n", Passage(hit.text, hit.id, hit.source), f"\n\n{UNSTORED}\n\nQuestion: {QUESTION}"]
    got = final(pipeline.stream_parts(parts, mode="reuse", params=SamplingParams(max_tokens=4)))
    assert got.sources == [{"text": hit.text, "id": hit.id, "source": hit.source, "score": None, "stored": True}]
    assert got.reused_tokens == len(pipeline.store.docs.chunks([hit.id])[hit.id].token_ids)
    assert PassageFinder(pipeline.store).split(UNSTORED) == [UNSTORED]


def test_bad_passages_are_refused(pipeline):
    for call, needle in [
        (lambda: pipeline.prepare_passages(QUESTION, []), "no passages"),
        (lambda: pipeline.prepare_passages("  ", [Passage(UNSTORED)]), "question is empty"),
        (lambda: pipeline.prepare_passages(QUESTION, [Passage(id=10**9)]), "neither in the store"),
        (lambda: pipeline.prepare_passages(QUESTION, [Passage(UNSTORED)], mode="magic"), "unknown mode"),
        (lambda: pipeline.prepare_parts([""]), "empty prompt"),
    ]:
        with pytest.raises(RequestError, match=needle):
            call()
