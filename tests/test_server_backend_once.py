"""The engine backend renders a chat once per request: it counted the chat (``chat_ids``) to check it
against the context, then ``add_chat_request`` rendered and tokenized the same messages again (and a
session turn's counts twice more). Now the one rendering (``LLM.render``) is counted and queued
(``LLM.add_rendered_chat``).

And a RAG question that the server refuses after retrieval (past the context) is refused through
``RagPipeline.start``'s ``check``, which releases the stored KV the prompt had opened."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import KEY, MODEL

pytestmark = pytest.mark.slow
TOKENS = 8
GREEDY = {"max_tokens": TOKENS, "temperature": 0}
PLAIN = [{"role": "user", "content": "Name three colours."}]
SYSTEM = [{"role": "system", "content": "You are a painter who answers in one short sentence."}, *PLAIN]
NEXT = {"role": "user", "content": "And one more?"}
# the tests that step the shared engine themselves come first: the server's loop owns it from its start on


# ---- a RAG question refused by the caller's check -------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, engine):
    from ragfuse.app import open_pipeline
    from tests.store_helpers import ingest_demo

    return open_pipeline(str(ingest_demo(tmp_path_factory.mktemp("rag"), engine)), engine=engine, gate=False)


def open_entry_files(root: Path) -> list[str]:
    """Files under ``root`` this process holds open (its stored-KV readers)."""
    fds = Path("/proc/self/fd")
    paths = []
    for fd in os.listdir(fds):
        try:
            paths.append(os.readlink(fds / fd))
        except OSError:  # closed since listed
            continue
    return [p for p in paths if p.startswith(str(root.resolve()))]


def test_a_question_refused_by_the_check_leaves_no_stored_kv_open(pipeline):
    """The check sees the assembled prompt, its chunks' KV open on disk; its refusal closes them and
    starts nothing (the server's copy of ``start`` did this by hand), and a check that passes gives
    the sampling the answer runs with."""
    from ragfuse.engine import RequestError, SamplingParams
    from ragfuse.engine.kvstore import DiskTier

    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    for tier in pipeline.store.kv.tiers:  # the next reads come from disk, each through an open reader
        if not tier.persistent:
            for key in list(disk.entry_keys()):
                tier.delete(key)
    seen: list[tuple[list[str], list[str]]] = []

    def refuse(prep: object) -> SamplingParams:
        seen.append(([s.tier for s in prep.sources], open_entry_files(disk.root / "data")))
        raise RequestError("too long")

    with pytest.raises(RequestError, match="too long") as refused:
        pipeline.start("When was the Hollowpoint lighthouse electrified?", "fuse", None, 2, check=refuse)
    tiers, held = seen[0]
    assert "disk" in tiers and held, seen  # the prompt's stored KV was open while checked
    # closed by the refusal itself, not when the prompt is collected: the error's traceback (a server's
    # log, a caller's handler) still holds it here
    assert refused.tb is not None and open_entry_files(disk.root / "data") == []
    assert not pipeline.engine.has_unfinished()

    def short(prep: object) -> SamplingParams:
        return SamplingParams(max_tokens=2, temperature=0.0)

    started = pipeline.start("When was the Hollowpoint lighthouse electrified?", "fuse", None, 2, check=short)
    last = None
    while last is None:
        last = next((o for o in pipeline.engine.step() if o.request_id == started.request_id and o.finished), None)
    assert len(last.token_ids) == 2 and last.finish_reason == "length"  # the check's sampling, not the default 64
    assert open_entry_files(disk.root / "data") == []


# ---- one rendering per chat request, through a live server ----------------------------------------


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, str]:
    """The engine's greedy text for each chat from its full rendering, as the old path queued it,
    computed before the server's loop owns the engine; the session's second turn follows the first's
    greedy answer."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    first, system = (o.text for o in llm.generate([llm.chat_ids(PLAIN), llm.chat_ids(SYSTEM)], params))
    second = llm.generate([llm.chat_ids(session_turn(first))], params)[0].text
    return {"plain": first, "system": system, "session": second}


def session_turn(answer: str) -> list[dict[str, str]]:
    return [*PLAIN, {"role": "assistant", "content": answer}, NEXT]


@pytest.fixture(scope="module")
def served(tmp_path_factory, llm, expected):
    from tests.server_helpers import serve_lighthouses

    with serve_lighthouses(tmp_path_factory.mktemp("store"), llm) as srv:
        yield srv


@contextmanager
def renders(tokenizer: object) -> Iterator[list[int]]:
    """Counts the tokenizer's ``apply_chat_template`` calls (each goes on to the real method)."""
    calls: list[int] = []
    real = tokenizer.apply_chat_template

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    tokenizer.apply_chat_template = counted
    try:
        yield calls
    finally:
        del tokenizer.apply_chat_template  # the class's method again


def chat(url: str, messages: list[dict[str, str]], **extra: object) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_plain_chat_is_rendered_once(served, expected):
    with renders(served.engine.tokenizer) as calls:
        text = chat(served.url, PLAIN)
    assert (len(calls), text) == (1, expected["plain"])  # was 2: counted, then rendered again to queue


def test_a_relay_chat_renders_the_chat_once_and_its_system_prompt_once(served, expected):
    """Relay renders the system message alone too, to split the chat after it (a token prefix)."""
    with renders(served.engine.tokenizer) as calls:
        text = chat(served.url, SYSTEM)
    assert (len(calls), text) == (2, expected["system"])  # was 3
    assert served.backend.relay_prompts() >= 1


def test_a_session_turn_renders_each_thing_it_counts_once(served, expected):
    """A session turn counts its new message (the chat rendered without it) and the header it keeps
    (two one-message chats told apart): with the chat itself, four renderings, each once."""
    assert chat(served.url, PLAIN, session_id="once") == expected["plain"]
    turn = session_turn(expected["plain"])
    with renders(served.engine.tokenizer) as calls:
        text = chat(served.url, turn, session_id="once")
    assert (len(calls), text) == (4, expected["session"])  # was 9
