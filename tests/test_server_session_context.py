"""A chat session turn whose new message fills the context by itself (no cut of the session's old
turns can make it fit) got the engine's plain 400, code and param null, although every other prompt
past the context is a ``context_length_exceeded`` on the field holding it; now it is one too, on
``messages``, counted by ``RenderedChat.turn_floor`` (the new message with the header kept before it)
and raised before any prefill."""

from __future__ import annotations

import httpx
import pytest

from ragfuse.engine import LLM
from tests.server_helpers import MODEL
from tests.test_server_context_precheck import AUTH, CONTEXT, forwards, post, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
LONG = "fox " * 600  # over 512 tokens however it is wrapped


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_turn_whose_new_message_fills_the_context_is_context_length_exceeded(
    server, forwards, stream  # noqa: F811
):
    url, engine = server
    session = f"long-turn-{stream}"
    first = [{"role": "user", "content": "Name three colours."}]
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": first, "session_id": session,
                                           "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    turn = [*first, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": LONG}]
    llm = LLM.from_engine(engine)
    new = llm.last_message_tokens(turn, None, llm.chat_ids(turn))
    assert CONTEXT <= new < len(llm.chat_ids(turn)), new  # the new message alone is past the context
    floor = llm.render(turn).turn_floor  # what the refusal counts: it and the header
    # listing the sessions runs the first turn's closing step (its answer's last token) now
    assert httpx.get(f"{url}/v1/sessions", headers=AUTH, timeout=60).status_code == 200
    forwards.clear()
    refused = post(url, "/v1/chat/completions", {"model": MODEL, "messages": turn, "session_id": session,
                                                 "max_tokens": 2, "stream": stream})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
    assert error["param"] == "messages", refused.text
    assert error["message"] == (
        f"the model's context is {CONTEXT} tokens, but the session turn's new message with its kept header alone "
        f"takes {floor} (messages), leaving none for the completion; shorten the session turn's new message with "
        "its kept header"), refused.text
    assert forwards == [], "a refused session turn ran the model"
    # the session is left as it was: a turn that fits continues it
    fits = [*turn[:2], {"role": "user", "content": "And one more?"}]
    again = post(url, "/v1/chat/completions", {"model": MODEL, "messages": fits, "session_id": session,
                                               "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again.text


def test_turn_floor_is_where_plan_turn_starts_to_refuse() -> None:
    """``turn_floor`` is the least a turn can be cut to: a reserve that fits beside it plans, one more
    token is refused (the server refuses by the same count, before the engine takes the turn)."""
    from ragfuse.engine.errors import RequestError
    from ragfuse.engine.sessions.history import plan_turn, turn_floor

    conversation, stored = list(range(100)), list(range(80))
    floor = turn_floor(len(conversation), 12, 7)
    assert floor == 19
    plan = plan_turn(conversation, stored, [(0, 80)], 64, 64 - floor, 12, 7)
    assert len(plan.token_ids) == floor and plan.token_ids[:7] == conversation[:7]
    with pytest.raises(RequestError, match="does not fit"):
        plan_turn(conversation, stored, [(0, 80)], 64, 65 - floor, 12, 7)


def started_session(url: str, session: str) -> list[dict[str, str]]:
    """A session's first turn, answered: its messages with the answer, for the next turn to extend."""
    first = [{"role": "user", "content": "Name three colours."}]
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": first, "session_id": session,
                                           "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return [*first, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]


def test_a_session_turn_that_only_its_kept_header_pushes_past_the_context_is_refused(
    server, forwards  # noqa: F811
):
    """The new message alone fits, but with the header the engine never cuts it does not: a
    ``context_length_exceeded`` on ``messages`` (the engine's plain 400 before), and with an explicit
    ``max_tokens`` that the floor leaves no room for, one on ``max_tokens``, both before any prefill."""
    url, engine = server
    turn = started_session(url, "kept-header")
    llm = LLM.from_engine(engine)

    def counts(n: int) -> tuple[list[dict[str, str]], int, int]:
        messages = [*turn, {"role": "user", "content": "fox " * n}]
        chat = llm.render(messages)
        return messages, chat.new_tokens, chat.turn_floor

    over = next(c for c in map(counts, range(300, 700)) if c[2] >= CONTEXT)
    assert over[1] < CONTEXT, over[1:]  # the new message alone is under the context
    short = next(c for c in map(counts, range(300, 700)) if c[2] >= CONTEXT - 8)
    assert short[2] < CONTEXT, short[1:]
    assert httpx.get(f"{url}/v1/sessions", headers=AUTH, timeout=60).status_code == 200
    forwards.clear()
    refused = post(url, "/v1/chat/completions", {"model": MODEL, "messages": over[0], "session_id": "kept-header",
                                                 "max_tokens": 2})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
    assert error["param"] == "messages" and f"alone takes {over[2]} (messages)" in error["message"], refused.text
    refused = post(url, "/v1/chat/completions", {"model": MODEL, "messages": short[0], "session_id": "kept-header",
                                                 "max_tokens": 9})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
    assert error["param"] == "max_tokens" and error["message"] == (
        f"the model's context is {CONTEXT} tokens, but this request needs {short[2] + 9}: {short[2]} for the "
        "session turn's new message with its kept header and 9 for the completion (max_tokens); shorten the "
        "session turn's new message with its kept header or lower max_tokens"), refused.text
    assert forwards == [], "a refused session turn ran the model"
    fits = [*turn, {"role": "user", "content": "And one more?"}]
    again = post(url, "/v1/chat/completions", {"model": MODEL, "messages": fits, "session_id": "kept-header",
                                               "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again.text


def test_a_session_turn_without_max_tokens_fits_under_a_limit_past_the_context(server):  # noqa: F811
    """The server's limit (1024) is past the 512-token context: a session turn that leaves
    ``max_tokens`` out reserved all of it and was refused however short; its answer's room is now
    capped to what the context leaves after the turn's floor, as a plain chat's is after its prompt."""
    url, engine = server
    turn = started_session(url, "no-max-tokens")
    short = [*turn, {"role": "user", "content": "Say yes."}]
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": short, "session_id": "no-max-tokens",
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    llm = LLM.from_engine(engine)
    assert r.json()["usage"]["completion_tokens"] <= CONTEXT - llm.render(short).turn_floor
    answered = [*short, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And one more?"}]
    again = post(url, "/v1/chat/completions", {"model": MODEL, "messages": answered, "session_id": "no-max-tokens",
                                               "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again.text


def test_a_session_turn_without_max_tokens_keeps_a_history_that_fits(server):  # noqa: F811
    """With the server's limit (1024) past the 512-token context, a turn that left ``max_tokens`` out
    reserved all the context past its floor for the answer, so the engine cut every earlier turn of a
    conversation of ~150 tokens. It now reserves at most half the context where the history would be
    cut for more: the whole conversation is fed and its stored KV reused."""
    url, engine = server
    session = "keeps-history"
    first = [{"role": "user", "content": "Remember these words: " + " ".join(f"w{i}" for i in range(40))}]
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": first, "session_id": session,
                                           "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    history = r.json()["usage"]["prompt_tokens"]
    turn = [*first, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Say yes."}]
    whole = len(LLM.from_engine(engine).render(turn).ids)
    assert history > CONTEXT // 4 and whole < CONTEXT // 2, (history, whole)
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": turn, "session_id": session,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == whole, usage  # nothing cut
    assert usage["prompt_tokens_details"]["cached_tokens"] >= history - 1, usage
    assert usage["completion_tokens"] <= CONTEXT - whole, usage
