"""A RAG turn in a session: the fused prompt and its answer become history the next turn reuses."""

from __future__ import annotations

from ragfuse.engine import SamplingParams
from ragfuse.engine.sessions import SessionStore
from tests.test_pipeline import QUESTION, pipeline, store  # noqa: F401 - fixtures

SP = SamplingParams(max_tokens=8)


def test_rag_turns_reuse_the_session_history(pipeline, engine, tmp_path):  # noqa: F811
    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype))
    try:
        first = pipeline.ask(QUESTION, mode="fuse", top_k=1, params=SP, session_id="rag")
        assert first.session_tokens_reused == 0 and first.session["session_tier"] is None
        history = len(engine.sessions.conversation("rag"))
        assert history == first.prompt_tokens + len(first.token_ids)
        second = pipeline.ask("Who built it?", mode="full", top_k=1, params=SP, session_id="rag")
        assert second.session["session_tier"] == "cpu"
        assert second.session_tokens_reused == history  # the answer's last token too (its closing step)
        assert second.prompt_tokens > history
        assert second.session["prefilled_tokens"] == second.prompt_tokens - second.session_tokens_reused
    finally:
        engine.sessions.close()
        engine.sessions = None


def test_a_rag_turn_started_before_the_last_ones_closing_step_follows_it_whole(pipeline, engine, tmp_path):  # noqa: F811
    """A server's loop: turn 2 starts after turn 1's last token but before turn 1's closing step
    (another client's prefill took the step after it), so turn 1 is not saved yet. Turn 2 follows
    the whole of turn 1, and the saved session's KV rows are its tokens (turn 2 was planned on an
    empty history but matched against turn 1 once saved: part of the prompt was fed twice and the
    stored rows no longer lined up with the conversation)."""
    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype))

    def run(question: str):
        started = pipeline.start(question, "fuse", None, 1, SP, "early")
        while True:
            for out in engine.step():
                if out.request_id == started.request_id and out.finished:
                    return out

    try:
        first = run(QUESTION)
        engine.add_request(engine.tokenize("word " * 300), SP)
        engine.step()  # a prefill step: turn 1's closing step has not run
        assert engine.sessions.sessions() == []
        second = run("Who built it?")
        while engine.has_unfinished():
            engine.step()
        engine.sessions.flush()
        # saved before its closing step, turn 1 has no KV of its last token yet: turn 2 computes it
        assert second.metrics["session_tokens_reused"] == first.prompt_tokens + len(first.token_ids) - 1
        (saved,) = engine.sessions.sessions()
        assert saved.tokens == second.prompt_tokens + len(second.token_ids) == saved.stored_rows
    finally:
        engine.sessions.close()
        engine.sessions = None
