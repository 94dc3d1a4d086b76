"""`ragfuse session ls|rm`: the conversations `generate --session` keeps, listed and deleted without a
server; a look at a folder without sessions creates nothing."""

from __future__ import annotations

import json

import pytest

from ragfuse.cli import main


def test_sessions_are_listed_and_removed_with_their_transcripts(tmp_path, capsys, engine):
    where = ["--session-dir", str(tmp_path / "sessions")]
    assert main(["session", "ls", *where]) == 0
    assert "no sessions under" in capsys.readouterr().out and not (tmp_path / "sessions").exists()
    for sid in ("ana", "bo"):
        assert main(["generate", "Hi, I am Ana.", "--session", sid, "--max-tokens", "3", "--device", "cpu",
                     *where]) == 0
    capsys.readouterr()
    assert main(["session", "ls", *where, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(s["session_id"] for s in listed["sessions"]) == ["ana", "bo"]
    assert all(s["tokens"] > 0 and s["nbytes"] > 0 for s in listed["sessions"])
    assert main(["session", "rm", "ana", *where]) == 0
    assert "removed session ana" in capsys.readouterr().out
    assert not (tmp_path / "sessions" / "chats" / "ana.json").exists()
    assert main(["session", "ls", *where, "--json"]) == 0
    assert [s["session_id"] for s in json.loads(capsys.readouterr().out)["sessions"]] == ["bo"]
    assert main(["session", "rm", "ana", "bo", *where]) == 2  # bo removed, ana named as missing
    captured = capsys.readouterr()
    assert "removed session bo" in captured.out and "no session ana under" in captured.err


def test_a_bad_session_id_is_refused(tmp_path, capsys):
    assert main(["session", "rm", "../x", "--session-dir", str(tmp_path)]) == 2
    assert "must be 1-128 letters" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one place at a time
        main(["session", "ls", "--session-dir", str(tmp_path), "--store", str(tmp_path)])


def test_ask_refuses_to_compare_a_session_turn_with_the_question_alone(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ask", "Who built it?", "--store", str(tmp_path), "--session", "s", "--compare"])
    assert exc.value.code == 2 and "would not be the same prompt" in capsys.readouterr().err


def test_generate_refuses_a_session_it_did_not_make(tmp_path, capsys, engine):
    """A RAG or server session keeps no transcript: `generate` would have replaced its conversation."""
    from ragfuse.engine import LLM, SamplingParams
    from ragfuse.engine.sessions import SessionStore

    engine.enable_sessions(SessionStore(tmp_path / "sessions", engine.fingerprint, engine.dtype))
    try:
        LLM.from_engine(engine).chat([{"role": "user", "content": "Hi."}], SamplingParams(max_tokens=3),
                                     session_id="theirs")
    finally:
        engine.sessions.close()
        engine.sessions = None
    assert main(["generate", "Hello?", "--session", "theirs", "--max-tokens", "3", "--device", "cpu",
                 "--session-dir", str(tmp_path / "sessions")]) != 0
    assert "that `generate` did not make" in capsys.readouterr().err
    assert not (tmp_path / "sessions" / "chats" / "theirs.json").exists()


def test_a_session_turn_beside_the_process_keeping_the_stores_sessions_is_refused_before_loading(
        tmp_path, capsys, monkeypatch):
    """An `ask --session` beside a server on the same store lost one of the two processes' turns (each
    works from its own memory of the sessions); it is refused at once, naming the holder, before
    seconds to minutes of model loading."""
    import os

    import ragfuse.app
    from ragfuse.engine.sessions.store import hold_sessions
    from tests.tiny_store import add_file, open_tiny

    root = tmp_path / "store"
    store = open_tiny(root)
    add_file(store, "/docs/a.txt", [0])
    store.close()

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the sessions were checked")

    monkeypatch.setattr(ragfuse.app, "open_pipeline", no_model)
    server = hold_sessions(root / "sessions")  # as a server on this store holds them
    assert main(["ask", "Who?", "--store", str(root), "--session", "s1"]) == 2
    err = capsys.readouterr().err
    assert f"in use by another process (pid {os.getpid()}" in err and "Send the turn to that process" in err
    server.release()
