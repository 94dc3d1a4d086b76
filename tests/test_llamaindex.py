"""The LlamaIndex connector with the real default model on CPU: the LLM's complete, chat and streaming;
query engines over a ragfuse store and over a ``VectorStoreIndex``, fusing the stored chunks' KV and
prefilling text that is not stored."""

from __future__ import annotations

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import TextNode

from ragfuse.connectors.llamaindex import RagfuseLLM, RagfuseRetriever, ragfuse_query_engine
from tests.store_helpers import connector_store

QUESTION = "When was the Hollowpoint lighthouse electrified?"
UNSTORED = "Records of the harbour board say the Hollowpoint lighthouse got electric light in 1952."
PARAMS = {"device": "cpu", "max_tokens": 16, "recompute_ratio": 0.2}


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


@pytest.fixture(scope="module")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from ragfuse.embeddings import DEFAULT_EMBEDDING_MODEL, embedding_model_path

    return HuggingFaceEmbedding(model_name=embedding_model_path(DEFAULT_EMBEDDING_MODEL), device="cpu")


def test_complete_chat_and_stream():
    llm = RagfuseLLM(**PARAMS)
    done = llm.complete("Name a colour.")
    assert done.text and 0 < done.additional_kwargs["completion_tokens"] <= 16
    assert done.additional_kwargs["ragfuse"]["reused_tokens"] == 0  # no store: everything prefilled
    parts = list(llm.stream_complete("Name a colour."))
    assert len(parts) > 2 and "".join(p.delta for p in parts) == parts[-1].text == done.text
    chat = llm.chat([ChatMessage(role="user", content="Name a colour.")])
    assert chat.message.content == done.text  # a completion is one user turn
    assert llm.metadata.is_chat_model and llm.metadata.context_window > 1000


def test_stop_is_a_string_a_list_or_none():
    """LlamaIndex callers pass ``stop`` as one string as often as a list: a string is one stop string."""
    llm = RagfuseLLM(**PARAMS)
    full = llm.complete("List the days of the week, comma separated:").text
    cut = full[: full.index("Tuesday")]  # greedy: "Monday: Monday\nTuesday..."
    assert "d" in cut  # what a stop split into characters ("T", "u", "e", "s", "d"...) would cut at
    for stop in ("Tuesday", ["Tuesday"]):
        assert llm.complete("List the days of the week, comma separated:", stop=stop).text == cut
    assert llm.complete("List the days of the week, comma separated:", stop=None).text == full


async def test_async_complete_and_stream():
    llm = RagfuseLLM(**PARAMS)
    done = await llm.acomplete("Say hi.")
    parts = [p async for p in await llm.astream_complete("Say hi.")]
    assert parts[-1].text == done.text and done.text


def test_flattened_prompt_with_stored_chunk_is_fused(store):
    node = RagfuseRetriever(store, 1).retrieve(QUESTION)[0]
    llm = RagfuseLLM(store=store, **PARAMS)
    msg = f"Context:\n{node.node.get_content(metadata_mode='llm')}\n\nQuestion: {QUESTION}"
    stats = llm.chat([ChatMessage(role="user", content=msg)]).additional_kwargs["ragfuse"]
    assert stats["reused_tokens"] > 0 and stats["sources"][0]["id"] == node.node.metadata["chunk_id"]


def test_query_engine_over_store_fuses_retrieved_chunks(store):
    llm = RagfuseLLM(store=store, **PARAMS)
    first = ragfuse_query_engine(store, llm=llm, similarity_top_k=2).query(QUESTION)
    response = ragfuse_query_engine(store, llm=llm, similarity_top_k=2).query(QUESTION)
    assert "1952" in str(response) and str(first) == str(response)
    stats = response.metadata["ragfuse"]
    # the first question behind the instruction prefix may have registered it for relay (computing its KV)
    assert first.metadata["ragfuse"]["reused_tokens"] in (stats["reused_tokens"],
                                                          stats["reused_tokens"] - stats["relay_system_tokens"])
    assert stats["reused_tokens"] > 0 and [s["stored"] for s in stats["sources"]] == [True, True]
    assert "lighthouses.md" in response.source_nodes[0].node.metadata["source"]

    streaming = ragfuse_query_engine(store, llm=llm, similarity_top_k=2, streaming=True).query(QUESTION)
    assert "".join(streaming.response_gen) == str(response)
    assert streaming.metadata["ragfuse"]["reused_tokens"] == stats["reused_tokens"]


def test_vector_store_index_nodes_fuse_by_content(store, embed_model):
    texts = [n.node.get_content() for n in RagfuseRetriever(store, 10).retrieve("anything")]
    # with the metadata a reader gives each node, which LlamaIndex writes before the node's text
    index = VectorStoreIndex([TextNode(text=t, metadata={"file_path": f"docs/{i}.md"}) for i, t in enumerate(texts)],
                             embed_model=embed_model)
    llm = RagfuseLLM(store=store, **PARAMS)
    response = ragfuse_query_engine(retriever=index.as_retriever(similarity_top_k=2), llm=llm).query(QUESTION)
    assert "1952" in str(response)
    stats = response.metadata["ragfuse"]
    assert stats["reused_tokens"] > 0 and all(s["stored"] for s in stats["sources"])
    # LlamaIndex's own synthesizer formats the nodes into its prompt: the chunks are found there again
    assert "1952" in str(index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION))


def test_vector_store_index_over_unstored_text_is_prefilled(store, embed_model):
    index = VectorStoreIndex([TextNode(text=UNSTORED)], embed_model=embed_model)
    llm = RagfuseLLM(store=store, **PARAMS)
    response = ragfuse_query_engine(retriever=index.as_retriever(similarity_top_k=1), llm=llm).query(QUESTION)
    assert "1952" in str(response)
    stats = response.metadata["ragfuse"]
    assert [s["stored"] for s in stats["sources"]] == [False]
    assert stats["reused_tokens"] == len(llm.pipeline().builder.prefix)  # the instruction prefix only
