"""Third connector audit, LlamaIndex side: what a demanding LlamaIndex user relies on, with the real default
model on CPU: the default query engine over the default store, call options refused rather than dropped,
non-text content refused, and a query's LLM call seen by LlamaIndex's callbacks with its true token counts."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock
from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler, TokenCountingHandler

from ragfuse.connectors.llamaindex import RagfuseLLM, ragfuse_query_engine
from tests.store_helpers import connector_store

QUESTION = "When was the Hollowpoint lighthouse electrified?"
PARAMS = {"device": "cpu", "max_tokens": 8, "recompute_ratio": 0.2}


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


def test_default_query_engine_fuses_from_the_default_store(store, monkeypatch):
    """``ragfuse_query_engine()`` retrieves from the default store (``$RAGFUSE_STORE``); its LLM must read
    the same store, not none at all (which prefilled every retrieved chunk, fusing nothing)."""
    monkeypatch.setenv("RAGFUSE_STORE", store)
    engine = ragfuse_query_engine(similarity_top_k=2)
    default_llm = engine._response_synthesizer._llm
    assert default_llm.store == store
    # the same LLM on the test's device and ratio (the default's gate would calibrate for minutes)
    engine._response_synthesizer._ragfuse = default_llm.model_copy(update=PARAMS)
    stats = engine.query(QUESTION).metadata["ragfuse"]
    relay = stats["relay_system_tokens"]
    assert stats["reused_tokens"] > relay and [s["stored"] for s in stats["sources"]] == [True, True]


def test_unknown_call_options_are_refused_not_ignored():
    """A ``top_k`` or ``max_new_tokens`` the engine does not take was dropped silently (the answer
    came back as if it had not been asked); the options it takes still work."""
    llm = RagfuseLLM(**PARAMS)
    for call in (lambda: llm.complete("Name a colour.", top_k=3),
                 lambda: llm.chat([ChatMessage(role="user", content="Name a colour.")], max_new_tokens=3),
                 lambda: list(llm.stream_complete("Name a colour.", top_k=3))):
        with pytest.raises(ValueError, match="does not take (top_k|max_new_tokens)"):
            call()
    assert llm.complete("Name a colour.", max_tokens=2).additional_kwargs["completion_tokens"] == 2


def test_non_text_content_is_refused():
    """An image block was dropped from the message and the model answered about a picture it never saw."""
    llm = RagfuseLLM(**PARAMS)
    message = ChatMessage(role="user", blocks=[TextBlock(text="What is in this picture?"),
                                               ImageBlock(url="http://example.com/x.png")])
    with pytest.raises(ValueError, match="text only, not 'image'"):
        llm.chat([message])
    text_only = ChatMessage(role="user", blocks=[TextBlock(text="Name a"), TextBlock(text="colour.")])
    assert llm.chat([text_only]).message.content


async def test_query_engine_answer_is_an_llm_event_with_its_token_counts(store):
    """LlamaIndex's own synthesizers call the LLM, so its callbacks see an ``LLM`` event per query
    (``LlamaDebugHandler``, ``TokenCountingHandler``); ragfuse's synthesizer answered beside them, and a
    query counted 0 LLM tokens. The counts are the engine's own, as ``metadata["ragfuse"]`` has them."""
    debug, counter = LlamaDebugHandler(), TokenCountingHandler()
    llm = RagfuseLLM(store=store, callback_manager=CallbackManager([debug, counter]), **PARAMS)
    responses = [ragfuse_query_engine(store, llm=llm, similarity_top_k=2).query(QUESTION),
                 await ragfuse_query_engine(store, llm=llm, similarity_top_k=2).aquery(QUESTION)]
    streaming = ragfuse_query_engine(store, llm=llm, similarity_top_k=2, streaming=True).query(QUESTION)
    streamed = "".join(streaming.response_gen)
    assert streamed == str(responses[0]) == str(responses[1])
    responses.append(streaming)

    stats = [r.metadata["ragfuse"] for r in responses]
    assert [e.prompt_token_count for e in counter.llm_token_counts] == [s["prompt_tokens"] for s in stats]
    assert all(e.completion_token_count > 0 for e in counter.llm_token_counts)
    pairs = debug.get_llm_inputs_outputs()
    assert len(pairs) == 3
    for start, end in pairs:
        prompt = start.payload["formatted_prompt"]
        assert QUESTION in prompt and "Hollowpoint lighthouse was first lit in 1871" in prompt
        assert end.payload["completion"].text == streamed


def test_a_query_engine_over_another_retriever_fuses_from_the_default_store(store, monkeypatch):
    """With a retriever of the caller's and no ``llm``, the LLM had no store at all: nothing fused."""
    from llama_index.core.retrievers import BaseRetriever

    class Nothing(BaseRetriever):
        def _retrieve(self, query_bundle):
            return []

    monkeypatch.setenv("RAGFUSE_STORE", store)
    assert ragfuse_query_engine(retriever=Nothing())._response_synthesizer._llm.store == store
    monkeypatch.setenv("RAGFUSE_STORE", store + "-not-ingested")
    assert ragfuse_query_engine(retriever=Nothing())._response_synthesizer._llm.store is None
