"""The LangChain connector with the real default model on CPU: the chat model's invoke, stream, stop and
usage; documents as separate parts; the standard "stuff documents" retrieval chain fusing stored KV,
and plain prefill for text that is not stored."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from ragfuse.connectors.langchain import ChatRagfuse, RagfuseRetriever
from tests.store_helpers import connector_store

QUESTION = "When was the Hollowpoint lighthouse electrified?"
UNSTORED = "Records of the harbour board say the Hollowpoint lighthouse got electric light in 1952."
PARAMS = {"device": "cpu", "max_tokens": 16, "recompute_ratio": 0.2}
INSTRUCTION = SystemMessage("Answer the question from the passages in a few words.")


@pytest.fixture(scope="module")
def store() -> str:
    return connector_store()


class _LastResult(BaseCallbackHandler):
    """The chat model's last response message, as a chain's callbacks see it."""

    def __init__(self) -> None:
        self.message: Any = None

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.message = response.generations[0][0].message


def test_invoke_stream_usage_and_stop():
    model = ChatRagfuse(**PARAMS)
    msg = model.invoke("Name a colour.")
    assert msg.content and msg.response_metadata["model_name"] == "smollm2-135m-instruct"
    usage = msg.usage_metadata
    assert usage["input_tokens"] == msg.response_metadata["ragfuse"]["prompt_tokens"] > 5
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= 16
    assert msg.response_metadata["ragfuse"]["reused_tokens"] == 0  # no store: everything prefilled

    chunks = list(model.stream("Name a colour."))
    assert "".join(c.content for c in chunks) == msg.content  # greedy: the same answer, token by token
    assert len(chunks) > 2 and chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1

    word = msg.content.split()[1]
    stopped = model.invoke("Name a colour.", stop=[word])
    assert stopped.content == msg.content[: msg.content.index(word)]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_documents_as_separate_parts_bring_their_stored_kv(store):
    docs = RagfuseRetriever(store=store, k=2).invoke(QUESTION)
    assert docs[0].metadata["chunk_id"] == int(docs[0].id) and "lighthouses.md" in docs[0].metadata["source"]
    model = ChatRagfuse(store=store, **PARAMS)
    by_kwarg = model.invoke([INSTRUCTION, HumanMessage(QUESTION)], documents=docs)
    blocks = [{"type": "text-plain", "mime_type": "text/plain", "text": d.page_content} for d in docs]
    by_blocks = model.invoke([INSTRUCTION, HumanMessage(content=[*blocks, {"type": "text", "text": QUESTION}])])
    for msg in (by_kwarg, by_blocks):
        fusion = msg.response_metadata["ragfuse"]
        assert "1952" in msg.content
        assert fusion["reused_tokens"] > 0 and fusion["tiers"]
        assert [s["stored"] for s in fusion["sources"]] == [True, True]
    assert by_kwarg.content == by_blocks.content
    # documents given whole keep their retriever's score in the sources (text stuffed into a prompt has none)
    assert [s["score"] for s in by_kwarg.response_metadata["ragfuse"]["sources"]] == [d.metadata["score"] for d in docs]
    plain = model.invoke([INSTRUCTION, HumanMessage(QUESTION)], documents=[UNSTORED])
    fusion = plain.response_metadata["ragfuse"]
    assert fusion["sources"][0]["stored"] is False and fusion["reused_tokens"] == 0


def _stuff_chain(model: ChatRagfuse, retriever: Any):
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question from the context in a few words.\n\n{context}"),
        ("human", "{input}"),
    ])
    return create_retrieval_chain(retriever, create_stuff_documents_chain(model, prompt))


def test_standard_retrieval_chain_fuses_stored_chunks(store):
    seen = _LastResult()
    chain = _stuff_chain(ChatRagfuse(store=store, **PARAMS), RagfuseRetriever(store=store, k=2))
    out = chain.invoke({"input": QUESTION}, config={"callbacks": [seen]})
    assert "1952" in out["answer"]
    fusion = seen.message.response_metadata["ragfuse"]
    assert fusion["reused_tokens"] > 0
    assert [s["id"] for s in fusion["sources"]] == [d.metadata["chunk_id"] for d in out["context"]]
    assert all(s["stored"] for s in fusion["sources"])


def test_retrieval_chain_prefills_text_not_stored(store):
    seen = _LastResult()
    outside = RunnableLambda(lambda _: [Document(page_content=UNSTORED)])  # any retriever's documents
    chain = _stuff_chain(ChatRagfuse(store=store, **PARAMS), outside)
    out = chain.invoke({"input": QUESTION}, config={"callbacks": [seen]})
    assert "1952" in out["answer"]
    fusion = seen.message.response_metadata["ragfuse"]
    assert fusion["reused_tokens"] == 0 and fusion["sources"] == [] and fusion["tiers"] == []


async def test_astream_matches_stream():
    model = ChatRagfuse(**PARAMS)
    sync = "".join(c.content for c in model.stream("Say hi."))
    chunks = [c async for c in model.astream("Say hi.")]
    assert "".join(c.content for c in chunks) == sync and chunks[-1].usage_metadata["output_tokens"] > 0


async def test_async_calls_read_the_store_from_worker_threads(store):
    docs = await RagfuseRetriever(store=store, k=2).ainvoke(QUESTION)
    model = ChatRagfuse(store=store, **PARAMS)
    chat = [INSTRUCTION, HumanMessage(QUESTION)]
    results = await model.abatch([chat, chat], documents=docs)
    assert results[0].content == results[1].content and "1952" in results[0].content
    assert all(r.response_metadata["ragfuse"]["reused_tokens"] > 0 for r in results)


def test_invoke_takes_langchains_stream_switch():
    """``invoke(stream=True)`` is LangChain's documented way to take the streaming path (and
    ``stream=False`` the other): the switch is LangChain's, the answer the same either way."""
    model = ChatRagfuse(**PARAMS)
    plain = model.invoke("Name a colour.")
    streamed = model.invoke("Name a colour.", stream=True)
    assert streamed.content == plain.content and streamed.usage_metadata == plain.usage_metadata
    assert model.invoke("Name a colour.", stream=False).content == plain.content


def test_stop_may_be_one_string():
    model = ChatRagfuse(**PARAMS)
    full = model.invoke("Name a colour.").content  # greedy: "The colour is a rare and precious one..."
    cut = full[: full.index("rare")]
    assert "e" in cut  # what a stop split into characters ("r", "a", "e") would cut at
    assert model.invoke("Name a colour.", stop="rare").content == cut
    assert model.invoke("Name a colour.", stop=["rare"]).content == cut


def test_bad_input_is_refused():
    model = ChatRagfuse(**PARAMS)
    with pytest.raises(ValueError, match="text only"):
        model.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])
    with pytest.raises(ValueError, match="does not take"):
        model.invoke("hi", tools=[])
    with pytest.raises(ValueError, match="unknown mode"):
        ChatRagfuse(mode="magic", device="cpu").invoke("hi")
    with pytest.raises(ValueError):
        ChatRagfuse(max_tokens=0)
    # documents need a question to answer; a document given as text must have some
    with pytest.raises(ValueError, match="documents= need a question: the last user message is empty"):
        model.invoke("   ", documents=[UNSTORED])
    with pytest.raises(ValueError, match="documents= need a question: there is no user message"):
        model.invoke([INSTRUCTION], documents=[UNSTORED])
    from ragfuse.engine.errors import RequestError

    with pytest.raises(RequestError, match="a passage given as text is empty"):
        model.invoke(QUESTION, documents=[""])
