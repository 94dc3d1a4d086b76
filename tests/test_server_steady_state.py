"""A long-running server's state does not grow with the requests it has served: after rounds of
requests on every path (answered, refused with 400, cut off by a client that goes away, sessions
under ever-new ids, chats under ever-new system prompts) the engine's per-request containers are
empty again, the KV cache's free blocks are back at their idle count, and what is kept on purpose
stays within its bound. A container that grew by one entry per request showed as a leak only after
days; here a few dozen requests show it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import pytest

from ragfuse.connectors.server.streaming import POLL_S
from ragfuse.engine.block_manager import BlockManager
from ragfuse.engine.llm_engine import MAX_SYSTEM_PROMPTS
from ragfuse.engine.prefix_tree import PrefixTree
from ragfuse.engine.sampling import SamplingParams
from ragfuse.engine.sequence import Sequence
from tests.server_helpers import KEY, MODEL, serve_lighthouses

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Name a colour."}]
STORY = [{"role": "user", "content": "Tell a long story about a lighthouse keeper and the sea."}]
QUESTION = "When was the Hollowpoint lighthouse electrified?"
SESSION_BYTES = 4 << 20  # a few short sessions' KV: ever-new ids soon evict the oldest


@pytest.fixture(scope="module")
def served(tmp_path_factory, llm):
    with serve_lighthouses(tmp_path_factory.mktemp("store"), llm, session_cpu_bytes=SESSION_BYTES,
                           session_disk_bytes=2 * SESSION_BYTES) as srv:
        yield srv


def post(url: str, path: str, body: dict, timeout: float = 120) -> int:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=timeout).status_code


def first_event_then_leave(url: str, path: str, body: dict) -> int:
    """Read a stream's first event and close the connection (a client gone mid-answer)."""
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}{path}", json=body, headers=AUTH) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))
        return r.status_code


def leave_before_the_answer(url: str) -> str:
    """A non-streamed chat whose client gives up before the answer comes: a story, all of its 60 tokens
    (the colour of ``CHAT`` was answered in a few tokens, within the 0.3 s on a quiet CI box)."""
    try:
        post(url, "/v1/chat/completions", {"model": MODEL, "messages": STORY, "max_tokens": 60}, timeout=0.3)
    except httpx.TimeoutException:
        return "left"
    return "answered"


def settle(served) -> None:
    """Wait until the engine has no request left (aborts of clients that left travel through its loop)
    and every session save has landed."""
    engine = served.engine
    deadline = time.monotonic() + 120
    while served.backend.running() or served.backend.queue_depth() or engine._seqs:
        assert time.monotonic() < deadline, "the engine kept requests running after every client was done"
        time.sleep(0.05)
    served.backend.sessions.flush()


def per_request_state(served) -> dict[str, int]:
    """What the engine keeps per request in flight: all empty once every request has ended."""
    e = served.engine
    return {"seqs": len(e._seqs), "detokenizers": len(e._detok), "pending": len(e._pending),
            "held": len(e._held), "session_turns": len(e._session_turns), "closing": len(e._closing),
            "waiting": len(e.scheduler.waiting), "running": len(e.scheduler.running),
            "starved": len(e.scheduler.starved)}


ROUND: list[tuple[str, Callable[[str], object]]] = [
    ("completion", lambda u: post(u, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})),
    ("chat stream read to its end", lambda u: post(u, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True})),
    ("chat stream left", lambda u: first_event_then_leave(u, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 40, "stream": True})),
    ("chat left before its answer", leave_before_the_answer),
    ("prompt past the context", lambda u: post(u, "/v1/completions", {
        "model": MODEL, "prompt": "x " * 9000, "max_tokens": 2})),
    ("unsupported option", lambda u: post(u, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True})),
    ("max_tokens past the server's limit", lambda u: post(u, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 5000})),
    ("rag", lambda u: post(u, "/v1/rag/query", {"question": QUESTION, "top_k": 1, "max_tokens": 2})),
    ("rag question past the context", lambda u: post(u, "/v1/rag/query", {
        "question": "lighthouse " * 9000, "top_k": 1, "max_tokens": 2})),
    ("rag stream left", lambda u: first_event_then_leave(u, "/v1/rag/query", {
        "question": QUESTION, "top_k": 1, "max_tokens": 40, "stream": True})),
]
# what each kind gets; a client that leaves before a non-streamed answer may still be answered first
EXPECTED = {"completion": {200}, "chat stream read to its end": {200}, "chat stream left": {200},
            "chat left before its answer": {"left", "answered"}, "prompt past the context": {400},
            "unsupported option": {400}, "max_tokens past the server's limit": {400}, "rag": {200},
            "rag question past the context": {400}, "rag stream left": {200}}


def test_requests_on_every_path_leave_the_engine_as_it_was_idle(served):
    """Rounds of every kind of request, happy and not, end with nothing per request left in the engine,
    the cache's free blocks at their count after the first round (which registers the RAG instruction
    as a relay prompt, held on purpose), and the prefix tree's eviction heap within its bound: every
    request that reused a cached prefix left one stale heap entry behind, never pruned while the cache
    had room (60 entries after 60 such requests over a two-node tree)."""
    url, engine = served.url, served.engine
    for name, send in ROUND:  # the first round: what stays registered or cached on purpose is in place
        assert send(url) in EXPECTED[name], name
    settle(served)
    idle_free = engine.blocks.num_free
    for _ in range(6):
        for name, send in ROUND:
            assert send(url) in EXPECTED[name], name
    settle(served)
    assert per_request_state(served) == dict.fromkeys(per_request_state(served), 0)
    assert engine.blocks.num_free == idle_free
    tree = engine.tree
    assert len(tree._lru) <= 2 * len(tree.nodes), (len(tree._lru), len(tree.nodes))


def test_a_client_that_gives_up_on_a_non_streamed_answer_logs_no_crash(served):
    """A client that stops waiting for a non-streamed answer is routine for a server up for days; its
    request was cancelled by raising CancelledError from the route, which the ASGI server logged as
    an application crash with a full traceback each time."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        assert leave_before_the_answer(served.url) == "left"
        settle(served)
        time.sleep(2 * POLL_S)  # the route sees the disconnect at its next poll, maybe after the engine idles
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert post(served.url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}) == 200


def test_a_reused_prefix_leaves_no_eviction_entries_behind():
    """The tree's eviction heap stays within twice its nodes however often a cached prefix is reused
    and released, and evicts as before: the least recently used leaves first, every block freed."""
    bm = BlockManager(num_blocks=8, block_size=2)
    tree = PrefixTree(bm)
    for n in range(200):  # the same two-block prefix again and again, as a server's chats share theirs
        s = Sequence(f"r{n}", [1, 2, 3, 4, 5], SamplingParams())
        tree.match(s)
        bm.grow(s.block_table, s.num_tokens)
        tree.insert(s, s.num_tokens)
        bm.release(s.block_table)
        tree.forget(s)
        assert len(tree._lru) <= 2 * len(tree.nodes)
    other = Sequence("other", [7, 8, 9], SamplingParams())
    tree.match(other)
    bm.grow(other.block_table, 3)
    tree.insert(other, 3)
    bm.release(other.block_table)
    tree.forget(other)
    table: list[int] = []
    bm.grow(table, 2 * 6)  # the five free blocks, then the least recently used leaf: [3, 4]
    assert (1, 2) in tree.root.children and not tree.root.children[(1, 2)].children
    assert (7, 8) in tree.root.children
    bm.release(table)
    tree.clear()
    assert len(tree) == 0 and len(bm.free_ids) == 8


def test_ever_new_system_prompts_stay_within_the_relay_bound(served):
    """Chats under a new system prompt each: the on-demand registry releases the least recently used,
    so registrations, their per-system prefix trees and the blocks they hold stay bounded."""
    engine = served.engine
    for n in range(MAX_SYSTEM_PROMPTS + 8):
        messages = [{"role": "system", "content": f"You are assistant number {n}."}, *CHAT]
        assert post(served.url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}) == 200
    settle(served)
    assert len(engine.systems) <= MAX_SYSTEM_PROMPTS
    assert len(engine.relay_prompts._used) <= MAX_SYSTEM_PROMPTS
    assert len(engine.tree._system_roots) <= MAX_SYSTEM_PROMPTS
    assert per_request_state(served) == dict.fromkeys(per_request_state(served), 0)


def test_ever_new_session_ids_leave_no_bookkeeping_behind(served, monkeypatch):
    """Chats under a new session id each, past the store's byte bounds: sessions are evicted, and
    with them goes what was kept per id. The store kept every id's last save and disk move (done
    long ago) and why each evicted session was gone, so these grew with the requests served."""
    from ragfuse.engine.sessions import store as session_store

    monkeypatch.setattr(session_store, "GONE_REASONS_KEPT", 4)
    sessions = served.backend.sessions
    n = 16
    for i in range(n):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "session_id": f"steady-{i}"}
        assert post(served.url, "/v1/chat/completions", body) == 200
    settle(served)
    assert httpx.get(f"{served.url}/v1/sessions", headers=AUTH, timeout=120).status_code == 200
    sessions.flush()
    assert 0 < len(sessions._records) < n  # the byte bounds evicted the oldest
    assert sessions._saving == {} and sessions._io_pending == {}
    assert len(sessions._gone) <= 4
    assert per_request_state(served) == dict.fromkeys(per_request_state(served), 0)


def test_evicted_session_still_says_why_it_recomputes(served):
    """The bound on kept reasons does not cost the recent ones: a session evicted a moment ago says so
    at its next turn, as before."""
    sessions = served.backend.sessions
    for i in range(12):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "session_id": f"why-{i}"}
        assert post(served.url, "/v1/chat/completions", body) == 200
    settle(served)
    gone = [sid for sid in (f"why-{i}" for i in range(12)) if sessions.tier_of(sid) is None]
    assert gone, "the byte bounds evicted none of the sessions"
    assert "evicted" in sessions.lookup(gone[-1]).reason
