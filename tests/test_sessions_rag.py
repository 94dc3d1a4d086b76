"""A RAG turn in a session: the fused prompt and its answer become history the next turn reuses."""

from __future__ import annotations

import pytest

from ragfuse.engine import SamplingParams
from ragfuse.engine.errors import RequestError
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


def test_a_follow_up_question_is_one_message_after_the_history_repeating_no_chunk_it_holds(
    pipeline, engine, tmp_path,  # noqa: F811
):
    """Turn 2 retrieves the chunk turn 1 brought: it is the template's next user header and the
    question, not a second instruction and a second copy of the chunk."""
    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype))
    try:
        first = pipeline.ask(QUESTION, mode="fuse", top_k=1, params=SP, session_id="follow")
        history = engine.sessions.conversation("follow")
        second = pipeline.ask("How tall is the Hollowpoint lighthouse?", mode="fuse", top_k=1, params=SP,
                              session_id="follow")
        assert second.sources[0]["id"] == first.sources[0]["id"]
        assert f"chunk {first.sources[0]['id']} is in this session's history already: not repeated" in second.notes
        head = pipeline.builder.turn_head(history)
        question = pipeline.builder.tail("How tall is the Hollowpoint lighthouse?", after_passages=False)
        assert second.session_tokens_reused == len(history)
        assert second.session["prefilled_tokens"] == len(head) + len(question)
        both = engine.sessions.conversation("follow")
        assert both[: len(history)] == history and both[len(history) :][: len(head + question)] == head + question
        prefix = pipeline.builder.prefix
        assert sum(both[i : i + len(prefix)] == prefix for i in range(len(both))) == 1
        text = engine.tokenizer.decode(both)
        assert text.count("<|im_start|>system") == 1 and text.count("<|im_start|>user") == 2
        assert "<|im_end|>\n<|im_start|>user" in text  # the first answer's turn closed, cut by max_tokens or not
    finally:
        engine.sessions.close()
        engine.sessions = None


def test_a_follow_up_repeats_a_chunk_the_model_no_longer_sees(pipeline):  # noqa: F811
    """A chunk held only where an earlier cut took the history (its rows no longer fed) comes again."""
    prep, _ = pipeline.prepare(QUESTION, 1, "fuse", None)
    try:
        prefix, chunk = prep.segments[0].token_ids, prep.segments[1].token_ids
        history = prefix + chunk + _words(pipeline, 40)
        cut = [(0, len(prefix)), (len(prefix) + len(chunk), len(history))]
        pipeline._as_follow_up(prep, "fuse", history, cut, 8)
        assert [s.label for s in prep.segments] == ["follow-up", f"chunk {prep.hits[0]['id']}", "question"]
        assert prep.sources == [prep.segments[1].kv]
    finally:
        pipeline._finish_sources(prep)
    prep, _ = pipeline.prepare(QUESTION, 1, "fuse", None)
    pipeline._as_follow_up(prep, "fuse", history, [(0, len(history))], 8)
    assert [s.label for s in prep.segments] == ["follow-up", "question"] and prep.sources == []


def _words(pipeline, n: int) -> list[int]:  # noqa: F811
    return pipeline.engine.tokenizer.encode(" word" * n, add_special_tokens=False)


@pytest.mark.parametrize("damage", ["flipped", "cut", "gone"])
def test_a_rag_turn_over_a_damaged_session_file_recomputes_the_history_and_keeps_it(
    pipeline, engine, tmp_path, damage: str,  # noqa: F811
):
    """A layer found damaged as the turn loads it used to fail the turn on an assertion (the retry's
    stats were on another turn object) and lose the session."""
    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype, cpu_bytes=0))
    try:
        pipeline.ask(QUESTION, mode="fuse", top_k=1, params=SP, session_id="hurt")
        history = engine.sessions.conversation("hurt")
        engine.sessions.flush()
        path = engine.sessions.disk.path_of(engine.sessions._records["hurt"].key)
        engine.sessions.close()
        data = bytearray(path.read_bytes())
        if damage == "gone":
            path.unlink()
        elif damage == "flipped":  # fails its checksum as the turn loads that layer
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:  # opens, then a later layer is not there
            path.write_bytes(bytes(data[: len(data) // 2]))
        engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype, cpu_bytes=0))
        again = pipeline.ask("How tall is the Hollowpoint lighthouse?", mode="fuse", top_k=1, params=SP,
                             session_id="hurt")
        assert again.session_tokens_reused == 0
        assert any(n.startswith("session hurt") and n.endswith("history recomputed") for n in again.notes), again.notes
        assert engine.sessions.conversation("hurt")[: len(history)] == history
    finally:
        engine.sessions.close()
        engine.sessions = None


def test_a_rag_question_cannot_follow_a_chat_session(pipeline, engine, tmp_path):  # noqa: F811
    from ragfuse.engine import LLM

    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype))
    try:
        LLM.from_engine(engine).chat([{"role": "user", "content": "Hi, I am Ana."}], SP, session_id="chat")
        with pytest.raises(RequestError, match="did not open with the RAG instruction"):
            pipeline.ask(QUESTION, mode="fuse", top_k=1, params=SP, session_id="chat")
    finally:
        engine.sessions.close()
        engine.sessions = None


def test_a_follow_up_leaves_out_a_chunk_its_own_shorter_prompt_keeps_in_view(pipeline, monkeypatch):  # noqa: F811
    """Near the context's end the whole prompt would cut the older of two held chunks from the
    history; once the newer one is left out, the prompt is short enough that it is not cut: both go."""
    prep, _ = pipeline.prepare(QUESTION, 2, "fuse", None)
    prefix, older, newer = prep.segments[0].token_ids, prep.segments[1].token_ids, prep.segments[3].token_ids
    pad = _words(pipeline, 10)
    rest = older + pad + newer + pad
    history = prefix + _words(pipeline, len(rest)) + rest  # half the body before the chunks: a cut's least
    head = pipeline.builder.turn_head(history)
    whole = len(head + older + pipeline.builder.separator + newer + pipeline.builder.tail(QUESTION))
    # the whole prompt needs 5 tokens more than half the body cut: 5 of the older chunk's go
    monkeypatch.setattr(pipeline.engine, "max_model_len", len(history) + whole + 8 - (len(rest) + 5))
    pipeline._as_follow_up(prep, "fuse", history, [(0, len(history))], 8)
    assert [s.label for s in prep.segments] == ["follow-up", "question"] and prep.sources == []
    assert sum("not repeated" in n for n in prep.notes) == 2


def test_a_session_runs_one_rag_turn_at_a_time(pipeline, engine, tmp_path):  # noqa: F811
    """Two turns side by side (a server's clients) both started from the same history, and the one saved
    first was lost without a word when the other was saved; the second is refused while the first runs."""
    engine.enable_sessions(SessionStore(tmp_path, engine.fingerprint, engine.dtype))

    try:
        first = pipeline.start(QUESTION, "fuse", None, 1, SP, "busy")
        with pytest.raises(RequestError, match="session busy has a turn in progress"):
            pipeline.start("How tall is it?", "fuse", None, 1, SP, "busy")
        engine.abort(first.request_id)  # an aborted turn runs no more
        second = pipeline.start("How tall is it?", "fuse", None, 1, SP, "busy")
        while engine.has_unfinished():
            engine.step()
        engine.close_turns()
        third = pipeline.start("Who keeps it?", "fuse", None, 1, SP, "busy")  # after the second finished
        assert third.request_id != second.request_id
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.sessions.close()
        engine.sessions = None
