"""An application that uses ragfuse through LangChain, LlamaIndex or the Python API for days does not
grow with the calls it made: after rounds of every kind of call (invoke, streams read to the end or
broken off early, sync and async, batches, refused calls, RAG in each mode, session turns under
ever-new ids) the shared engine's per-request containers, the step router's boxes, the connectors'
module-level tables and the threads alive are back where they were after the first round, and the
KV cache's free blocks are back at their idle count. What is kept on purpose stays within its bound
(relay registrations: ``MAX_SYSTEM_PROMPTS``). A container that grew by one entry per call showed
only after days; a few rounds show it here."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage

from ragfuse.app import open_pipeline, shared_pipeline
from ragfuse.connectors.langchain import ChatRagfuse
from ragfuse.connectors.langchain import RagfuseRetriever as LangChainRetriever
from ragfuse.connectors.langchain.documents import document_passage
from ragfuse.connectors.llamaindex import RagfuseLLM, ragfuse_query_engine, synthesizer
from ragfuse.engine import SamplingParams
from ragfuse.engine.errors import RequestError
from ragfuse.engine.kvstore.disk import DiskEntryReader
from ragfuse.engine.kvstore.source import LayerwiseSource
from ragfuse.engine.llm import LLM
from ragfuse.engine.llm_engine import MAX_SYSTEM_PROMPTS
from ragfuse.engine.step_router import StepRouter
from ragfuse.passage import Passage
from ragfuse.pipeline import RagPipeline
from tests.store_helpers import connector_store

pytestmark = pytest.mark.slow
QUESTION = "When was the Hollowpoint lighthouse electrified?"
PARAMS = {"device": "cpu", "max_tokens": 3, "recompute_ratio": 0.2}
LONG = "x " * 9000  # past the model's context: refused
SHORT = SamplingParams(max_tokens=3)
LONGER = SamplingParams(max_tokens=30)  # a stream broken off after its first output leaves most undecoded


class Calls:
    """Every kind of call an application makes, over one store and the one shared engine."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.chat = ChatRagfuse(store=store, **PARAMS)
        self.llm = RagfuseLLM(store=store, **PARAMS)
        self.query = ragfuse_query_engine(store, llm=self.llm, similarity_top_k=1)
        self.streamed_query = ragfuse_query_engine(store, llm=self.llm, similarity_top_k=1, streaming=True)
        self.pipe: RagPipeline = shared_pipeline(store, device="cpu", gate=False)  # the connectors' (r* given)
        self.api = LLM.from_engine(self.pipe.engine)
        self.api.enable_sessions(cpu_bytes=4 << 20)  # a few short sessions: ever-new ids evict the oldest
        self.turn = 0

    def round(self) -> None:
        """One call of each kind; ``turn`` makes the session ids new each round."""
        self.turn += 1
        self.langchain()
        self.llamaindex()
        self.pipeline()
        self.python_api()
        asyncio.run(self.asynchronous())

    def langchain(self) -> None:
        chat = self.chat
        chat.invoke("Name a colour.")
        chat.invoke([SystemMessage(f"You are helper {self.turn}."), HumanMessage("Hi")])
        "".join(str(c.content) for c in chat.stream(QUESTION))
        for _ in chat.stream(QUESTION, max_tokens=30):
            break
        chat.batch(["a", "b"])
        chat.invoke([HumanMessage(QUESTION)], documents=LangChainRetriever(store=self.store, k=1).invoke(QUESTION))
        with pytest.raises(ValueError):
            chat.invoke("x", top_k=3)
        with pytest.raises(RequestError):
            chat.invoke("x", mode="nope")
        with pytest.raises(RequestError):
            chat.invoke(LONG)

    def llamaindex(self) -> None:
        llm = self.llm
        llm.complete("Name a colour.")
        llm.chat([ChatMessage(role="system", content=f"You are helper {self.turn}."),
                  ChatMessage(role="user", content="Hi")])
        list(llm.stream_complete("Hello"))
        for _ in llm.stream_complete("Name a colour.", max_tokens=30):
            break
        with pytest.raises(ValueError):
            llm.complete("x", top_k=2)
        with pytest.raises(RequestError):
            llm.complete(LONG)
        self.query.query(QUESTION)
        str(self.streamed_query.query(QUESTION))
        response = self.streamed_query.query(QUESTION)
        for _ in response.response_gen:
            break
        del response  # its stream is closed as the response goes

    def pipeline(self) -> None:
        pipe = self.pipe
        for mode in ("fuse", "full", "reuse", "prefix"):
            pipe.ask(QUESTION, mode=mode, top_k=1, params=SHORT)
        for _ in pipe.stream(QUESTION, top_k=1, params=LONGER):
            break
        with pytest.raises(RequestError):
            pipe.ask("lighthouse " * 9000, top_k=1, params=SHORT)
        with pytest.raises(RequestError):
            pipe.ask(QUESTION, mode="bad")
        pipe.ask(QUESTION, top_k=1, params=SHORT, session_id=f"rag-{self.turn}")

    def python_api(self) -> None:
        api = self.api
        api.generate(["a", "b"], SHORT)
        for _ in api.stream("Hello", LONGER):
            break
        with pytest.raises(RequestError):
            api.generate(["a", LONG], SHORT)  # all or none: the good prompt is aborted too
        api.chat([{"role": "user", "content": "Hi"}], SHORT, session_id=f"chat-{self.turn}")

    async def asynchronous(self) -> None:
        await self.chat.ainvoke("Name a colour.")
        async for _ in self.chat.astream(QUESTION, max_tokens=30):
            break  # dropped unclosed
        stream = self.chat.astream(QUESTION, max_tokens=30)
        async for _ in stream:
            break
        await stream.aclose()
        await self.llm.acomplete("Hi")
        async for _ in await self.llm.astream_complete("Name a colour.", max_tokens=30):
            break
        await self.query.aquery(QUESTION)
        response = await self.streamed_query.aquery(QUESTION)
        async for _ in response.async_response_gen():
            break


@pytest.fixture(scope="module")
def calls() -> Calls:
    return Calls(connector_store())


def state(calls: Calls) -> dict[str, int]:
    """What the process keeps per call in flight, and what it keeps on purpose: the former must be
    what it was when idle, the latter within its bound."""
    gc.collect()  # dropped streams and responses are freed, as a long-running process's would be
    engine = calls.pipe.engine
    router = StepRouter.of(engine)
    sessions = engine.sessions
    assert sessions is not None
    sessions.flush()
    return {"seqs": len(engine._seqs), "detokenizers": len(engine._detok), "pending": len(engine._pending),
            "held": len(engine._held), "session_turns": len(engine._session_turns),
            "closing": len(engine._closing), "waiting": len(engine.scheduler.waiting),
            "running": len(engine.scheduler.running), "starved": len(engine.scheduler.starved),
            "router_boxes": len(router._boxes), "router_closed": len(router._closed),
            "stream_stats": len(synthesizer._STREAM_STATS), "closing_streams": len(synthesizer._CLOSING_STREAMS),
            "session_saving": len(sessions._saving), "session_io": len(sessions._io_pending),
            "session_pins": len(sessions._pins), "free_blocks": engine.blocks.num_free,
            "threads": threading.active_count()}


def test_rounds_of_every_call_leave_the_process_as_it_was_idle(calls: Calls):
    """After the first round (which loads the models, stores the KV computed on a miss and registers
    the RAG instruction as a relay prompt, held on purpose) further rounds leave everything as it was."""
    calls.round()
    idle = state(calls)
    for _ in range(2):
        calls.round()
    after = state(calls)
    assert after == idle
    assert {k: v for k, v in idle.items() if k not in ("free_blocks", "threads", "closing_streams")} == dict.fromkeys(
        ("seqs", "detokenizers", "pending", "held", "session_turns", "closing", "waiting", "running", "starved",
         "router_boxes", "router_closed", "stream_stats", "session_saving", "session_io", "session_pins"), 0)
    assert idle["closing_streams"] == 2  # a fixed map of LlamaIndex's two response types to ours


def test_ever_new_system_prompts_stay_within_the_relay_bound(calls: Calls):
    """Chats under a new system prompt each with relay: the registry releases the least recently used,
    so registrations and the blocks they hold stop growing at the bound."""
    engine = calls.pipe.engine

    def chats(first: int, count: int) -> None:
        for n in range(first, first + count):
            calls.api.chat([{"role": "system", "content": f"You are assistant number {n}."},
                            {"role": "user", "content": "Hi"}], SHORT, relay=True)

    chats(0, MAX_SYSTEM_PROMPTS)
    full = state(calls)
    assert len(engine.systems) <= MAX_SYSTEM_PROMPTS
    chats(MAX_SYSTEM_PROMPTS, 8)
    assert len(engine.systems) <= MAX_SYSTEM_PROMPTS
    assert len(engine.relay_prompts._used) <= MAX_SYSTEM_PROMPTS
    assert len(engine.tree._system_roots) <= MAX_SYSTEM_PROMPTS
    assert state(calls) == full


def open_readers() -> int:
    """Stored KV entries whose file is open for reading, in the whole process."""
    gc.collect()
    return sum(type(o) is DiskEntryReader and not o._f.closed for o in gc.get_objects())


def test_a_prompt_refused_while_assembled_leaves_no_stored_kv_open(calls: Calls):
    """A prompt refused as it is assembled (an empty passage after a stored chunk) closed none of the
    stored KV opened before the refusal: every refused call kept a disk entry's file open for as long
    as its error lived (a caller's log, a framework's callbacks), closed only by the collector."""
    # a pipeline of its own: its memory tiers are empty, so the stored chunk is read from disk
    pipe = open_pipeline(calls.store, device="cpu", engine=calls.pipe.engine, gate=False)
    try:
        doc = LangChainRetriever(store=calls.store, k=1).invoke(QUESTION)[0]
        stored = document_passage(doc)
        prep = pipe.prepare_parts([stored])
        assert isinstance(prep.sources[0], LayerwiseSource)  # read from disk: the case at stake
        for src in prep.sources:
            src.finish()
        assert open_readers() == 0
        refusals = [lambda: pipe.prepare_parts(["Hi", stored, Passage("")]),
                    lambda: pipe.prepare_passages(QUESTION, [stored, Passage("")]),
                    lambda: list(pipe.stream_parts([stored, Passage("")], params=SHORT))]
        errors: list[RequestError] = []
        for _ in range(3):
            for refuse in refusals:
                with pytest.raises(RequestError, match="a passage given as text is empty") as caught:
                    refuse()
                errors.append(caught.value)  # kept, with its traceback
        assert open_readers() == 0
    finally:
        pipe.store.close()
