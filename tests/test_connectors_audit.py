"""Second connector audit: framework contracts the first tests did not cover, with the real default
model on CPU and the real frameworks (LangChain's LLM cache, chat roles in LangChain and LlamaIndex)."""

from __future__ import annotations

from langchain_core.caches import InMemoryCache
from langchain_core.messages import ChatMessage as LCChatMessage
from langchain_core.messages import HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage

from ragfuse.connectors.langchain import ChatRagfuse
from ragfuse.connectors.llamaindex import RagfuseLLM, ragfuse_query_engine
from tests.store_helpers import connector_store

PARAMS = {"device": "cpu", "recompute_ratio": 0.2}
QUESTION = "When was the Hollowpoint lighthouse electrified?"
SYSTEM = "You are a pirate. Answer in one short sentence."


def test_llm_cache_keeps_differently_configured_models_apart():
    """LangChain's LLM cache keys an answer by the model's ``_identifying_params``: a model with
    ``max_tokens=8`` must not be handed the answer cached for one with ``max_tokens=3``."""
    cache = InMemoryCache()
    short = ChatRagfuse(cache=cache, max_tokens=3, **PARAMS).invoke("Name a colour.")
    longer = ChatRagfuse(cache=cache, max_tokens=8, **PARAMS).invoke("Name a colour.")
    assert short.usage_metadata["output_tokens"] == 3
    assert longer.usage_metadata["output_tokens"] == 8 and longer.content.startswith(short.content)
    again = ChatRagfuse(cache=cache, max_tokens=3, **PARAMS).invoke("Name a colour.")
    assert again.content == short.content  # the cache still serves the same configuration


def test_llamaindex_developer_and_model_roles_reach_the_template_as_system_and_assistant():
    """LlamaIndex's ``developer`` (OpenAI's newer system), ``chatbot`` and ``model`` roles are the
    roles the chat template knows, not names it would print verbatim into the prompt."""
    llm = RagfuseLLM(max_tokens=4, **PARAMS)

    def chat(system_role: str, assistant_role: str) -> tuple[str, int]:
        out = llm.chat([ChatMessage(role=system_role, content=SYSTEM), ChatMessage(role="user", content="Hi."),
                        ChatMessage(role=assistant_role, content="Ahoy!"),
                        ChatMessage(role="user", content="Name a colour.")])
        return out.message.content, out.additional_kwargs["prompt_tokens"]

    expected = chat("system", "assistant")
    assert chat("developer", "model") == expected
    assert chat("system", "chatbot") == expected


def test_langchain_developer_role_is_a_system_message():
    model = ChatRagfuse(max_tokens=4, **PARAMS)
    question = HumanMessage("Name a colour.")
    plain = model.invoke([SystemMessage(SYSTEM), question])
    developer = model.invoke([LCChatMessage(role="developer", content=SYSTEM), question])
    assert developer.content == plain.content and developer.usage_metadata == plain.usage_metadata


async def test_query_engine_sources_name_their_chunks_sync_and_async():
    """The fusion statistics of a query name the chunk and document of each retrieved node (as the
    LangChain connector's do), not an anonymous ``id: None, source: ""`` per passage."""
    store = connector_store()
    llm = RagfuseLLM(store=store, max_tokens=4, **PARAMS)
    engine = ragfuse_query_engine(store, llm=llm, similarity_top_k=2)
    for response in (engine.query(QUESTION), await engine.aquery(QUESTION)):
        nodes = response.source_nodes
        assert [n.score for n in nodes] == sorted((n.score for n in nodes), reverse=True) and nodes[0].score > 0
        sources = response.metadata["ragfuse"]["sources"]
        assert [s["id"] for s in sources] == [n.node.metadata["chunk_id"] for n in nodes]
        assert [s["source"] for s in sources] == [n.node.metadata["source"] for n in nodes]
        assert [s["score"] for s in sources] == [n.score for n in nodes]  # as `ask --json` reports them
        assert all(s["stored"] for s in sources) and "lighthouses.md" in sources[0]["source"]


async def test_abandoned_astream_and_cancelled_ainvoke_free_their_kv():
    """Not a fix, a contract held: a stream left halfway and a cancelled task abort their engine
    requests (all their cache blocks back), and the next call on the engine is answered whole."""
    import asyncio
    import contextlib

    model = ChatRagfuse(max_tokens=4, **PARAMS)
    expected = (await model.ainvoke("Name a colour.")).content
    engine = model._pipeline().engine
    free = engine.blocks.num_free
    long = ChatRagfuse(max_tokens=2000, **PARAMS)
    stream = long.astream("Tell a very long story about dragons.")
    async for _ in stream:
        break
    await stream.aclose()
    task = asyncio.create_task(long.ainvoke("Tell a very long story about dragons."))
    while not engine.has_unfinished():  # the request runs
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # the worker thread of each notices at its next token and aborts; a deferred abort is settled by
    # the next call, so a few calls bound it however the threads are scheduled
    for _ in range(5):
        assert (await model.ainvoke("Name a colour.")).content == expected
        if not engine.has_unfinished() and engine.blocks.num_free == free:
            break
    assert not engine.has_unfinished() and engine.blocks.num_free == free


def test_what_needs_only_the_model_calibrates_no_gate(monkeypatch):
    """Making a LlamaIndex query engine reads its LLM's context window, and LangChain's token counts
    (``trim_messages``) its tokenizer: both made the store's pipeline, whose accuracy gate (no ratio set)
    calibrated r* right there, 5.5 minutes on the CI box with no r* cached, before any question. Now they
    take the engine."""
    import ragfuse.gate
    from ragfuse.app import forget_shared

    store = connector_store()
    forget_shared()  # a pipeline an earlier test made would hide a calibration

    def calibrating(*_args: object, **_kwargs: object) -> float:
        raise AssertionError("the accuracy gate calibrated")

    monkeypatch.setattr(ragfuse.gate, "calibrated_r_star", calibrating)
    monkeypatch.setenv("RAGFUSE_STORE", store)
    engine = ragfuse_query_engine(similarity_top_k=2)
    assert engine._response_synthesizer._llm.metadata.context_window >= 4096
    chat = ChatRagfuse(store=store, device="cpu")
    assert len(chat.get_token_ids("The Hollowpoint lighthouse")) > 3
    assert chat.get_num_tokens_from_messages([SystemMessage(SYSTEM), HumanMessage("Name a colour.")]) > 5
