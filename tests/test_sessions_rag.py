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
