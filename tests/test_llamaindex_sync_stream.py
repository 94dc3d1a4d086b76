"""A LlamaIndex streaming query read synchronously (``for tok in response.response_gen``), with the real
default model on CPU: a reader that stops early frees the engine while the response object lives on (an app
keeps it for its sources), and a stream read to its end is the non-streamed answer."""

from __future__ import annotations

import pytest

from ragfuse.app import shared_pipeline
from ragfuse.connectors.llamaindex import RagfuseLLM, ragfuse_query_engine
from tests.store_helpers import connector_store

QUESTION = "When was the Hollowpoint lighthouse electrified?"
PARAMS = {"device": "cpu", "max_tokens": 48, "recompute_ratio": 0.2}  # long enough to stop halfway


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


@pytest.fixture(scope="module")
def reference(store: str) -> str:
    """The non-streamed answer, made before any stream was left unfinished."""
    return str(_query_engine(store, streaming=False).query(QUESTION))


def _query_engine(store: str, streaming: bool):
    return ragfuse_query_engine(store, llm=RagfuseLLM(store=store, **PARAMS), similarity_top_k=2,
                                streaming=streaming)


def _has_unfinished() -> bool:
    """Whether the engine the connector shares (one per model and device) has a running or waiting request."""
    return shared_pipeline(None, device="cpu").engine.has_unfinished()


def test_breaking_out_of_the_stream_aborts_its_request(store, reference):
    """Before, LlamaIndex's ``StreamingResponse`` held the answer's stream open: the request stayed in the
    engine, decoding alongside every later request to its last token."""
    response = _query_engine(store, streaming=True).query(QUESTION)
    read = []
    for tok in response.response_gen:
        read.append(tok)
        if len(read) == 3:
            break
    assert not _has_unfinished()
    assert response.source_nodes  # the response lives on
    assert str(_query_engine(store, streaming=False).query(QUESTION)) == reference
    assert reference.startswith("".join(read)) and len("".join(read)) < len(reference)
    # a later read gives the text read so far, as an async stream does (the rest was never decoded)
    assert str(response) == "".join(read) == "".join(response.response_gen)


def test_a_stream_read_to_its_end_is_the_answer(store, reference):
    response = _query_engine(store, streaming=True).query(QUESTION)
    assert "".join(response.response_gen) == reference
    assert not _has_unfinished()
    assert response.metadata["ragfuse"]["reused_tokens"] > 0
    assert str(response) == response.get_response().response == reference
    assert "".join(_query_engine(store, streaming=True).query(QUESTION).response_gen) == reference


def test_next_steps_the_stream_as_llamaindexs_generator_does(store, reference):
    """``next(response.response_gen)`` works as on LlamaIndex's own generator, and a ``for`` after it
    goes on where it stopped: together they read the whole answer once."""
    response = _query_engine(store, streaming=True).query(QUESTION)
    first = next(response.response_gen)
    assert first + "".join(response.response_gen) == reference
    assert not _has_unfinished()
