"""A chat session turn whose new message fills the context by itself (no cut of the session's old
turns can make it fit) got the engine's plain 400, code and param null, although every other prompt
past the context is a ``context_length_exceeded`` on the field holding it; now it is one too, on
``messages``, counted by ``LLM.last_message_tokens`` and raised before any prefill."""

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
    # listing the sessions runs the first turn's closing step (its answer's last token) now
    assert httpx.get(f"{url}/v1/sessions", headers=AUTH, timeout=60).status_code == 200
    forwards.clear()
    refused = post(url, "/v1/chat/completions", {"model": MODEL, "messages": turn, "session_id": session,
                                                 "max_tokens": 2, "stream": stream})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
    assert error["param"] == "messages", refused.text
    assert error["message"] == (
        f"the model's context is {CONTEXT} tokens, but the session turn's new message alone takes {new} "
        f"(messages), leaving none for the completion; shorten the session turn's new message"), refused.text
    assert forwards == [], "a refused session turn ran the model"
    # the session is left as it was: a turn that fits continues it
    fits = [*turn[:2], {"role": "user", "content": "And one more?"}]
    again = post(url, "/v1/chat/completions", {"model": MODEL, "messages": fits, "session_id": session,
                                               "max_tokens": 2})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again.text
