"""``ragfuse generate``: answer one prompt with the engine (chat template applied)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ragfuse.engine.atomic_file import write_atomic
from ragfuse.engine.errors import RequestError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate an answer to PROMPT offline")
    p.add_argument("prompt", help="the user message")
    add_model_args(p)
    p.add_argument("--system", help="system prompt (its KV computed once, served by relay attention)")
    p.add_argument("--no-relay", action="store_true", help="run the system prompt as part of the prompt instead")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 to 100 (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the likeliest tokens up to this probability mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (0: off)")
    p.add_argument("--seed", type=int, help="sampling seed, 0 to 2**64 - 1, for repeatable samples")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template: PROMPT is the whole prompt")
    p.add_argument("--session", metavar="ID", help="continue conversation ID (its KV is kept between calls)")
    # `serve` spells it --sessions-dir: both spellings work here, so neither command refuses the other's
    p.add_argument("--session-dir", "--sessions-dir", dest="session_dir", metavar="DIR", default=None,
                   help="where sessions live (default $RAGFUSE_SESSIONS, else the per-user data directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:  # argparse's own message names this function ("invalid positive_int value")
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def unit_ratio(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= r <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {r}")
    return r


def add_model_args(p: argparse.ArgumentParser, store: bool = False) -> None:
    """``--model``, ``--device``, ``--dtype``; with ``store`` the model defaults to the store's (one
    given must be it), so a store ingested with another model is not served by the default one."""
    default = "(default: the store's; for a new one smollm2-135m-instruct)" if store else "[smollm2-135m-instruct]"
    p.add_argument("--model", default=None if store else "smollm2-135m-instruct",
                   help=f"alias, local path (HF dir or .gguf) or hub id {default}")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: CUDA when available, else CPU)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import LLM, SamplingParams

    if not args.prompt.strip():
        raise SystemExit(_usage_error("PROMPT is empty"))
    if args.raw and args.system is not None:  # --raw sends PROMPT alone: the system prompt would be dropped unsaid
        raise SystemExit(_usage_error("--system needs the chat template (drop --raw, or put it in PROMPT)"))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop,
    )
    transcript: Path | None = None
    history: list[dict[str, str]] = []
    if args.session is not None:
        from ragfuse.engine.sessions import check_session_id

        if args.raw:
            raise SystemExit(_usage_error("--session needs the chat template (drop --raw)"))
        check_session_id(args.session)
        transcript = transcript_path(sessions_dir(args.session_dir), args.session)
        history = _read_transcript(transcript, args.session)  # before the model loads: a bad one fails at once
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    if args.max_tokens > llm.engine.max_model_len:  # the engine would quietly cut it to what the context leaves
        raise SystemExit(_usage_error(f"--max-tokens {args.max_tokens} is more than the context of "
                                      f"{llm.engine.model_name}, {llm.engine.max_model_len} tokens"))
    system_id = None
    system_s = 0.0  # registering a relayed system prompt: its KV computed once, outside any request's timing
    if transcript is not None:
        final = _session_turn(llm, args, params, transcript, history)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        if args.raw:
            prompt = args.prompt
        elif args.system and not args.no_relay:
            t1 = time.perf_counter()
            system_id, prompt = llm.relay_chat_ids(messages, args.system)
            system_s = time.perf_counter() - t1
        else:
            prompt = llm.chat_ids(messages, args.system)
        final = None
        try:
            for out in llm.stream(prompt, params, system=system_id):
                final = out  # before the write: a Ctrl-C right after it must see text on the line
                if not args.json:
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            if final is not None and not args.json:
                sys.stdout.write("\n")  # the answer so far ends its line; the shell's prompt starts a new one
            raise
    assert final is not None
    if args.json:
        relay_tokens = final.metrics.get("relay_system_tokens", 0)
        print(json.dumps({  # prompt_tokens counts a relayed system prompt too, as the server's usage does
            "text": final.text, "token_ids": final.token_ids, "prompt_tokens": final.prompt_tokens + relay_tokens,
            "relay_system_tokens": relay_tokens,
            "completion_tokens": len(final.token_ids), "finish_reason": final.finish_reason,
            "ttft_s": final.ttft_s, "total_s": final.total_s, "load_s": load_s, "system_s": system_s,
            "model": llm.engine.model_name, "device": str(llm.engine.device), "relay": system_id is not None,
            **{k: v for k, v in final.metrics.items() if k.startswith("session") or k == "prefilled_tokens"},
        }))
    else:
        sys.stdout.write("\n")
    return 0


def sessions_dir(given: str | None) -> Path:
    """Where `generate --session` keeps sessions: ``given`` (``--session-dir``), else
    ``$RAGFUSE_SESSIONS``, else the per-user data directory's ``sessions``."""
    import platformdirs

    return Path(given or os.environ.get("RAGFUSE_SESSIONS")
                or Path(platformdirs.user_data_dir("ragfuse")) / "sessions").expanduser()


def transcript_path(root: Path, session: str) -> Path:
    """Where a `generate` session's messages live: ``chats/ID.json`` beside the sessions' KV."""
    return root / "chats" / f"{session}.json"


def _read_transcript(path: Path, session: str) -> list[dict[str, str]]:
    """The session's messages so far ([] for a new one). One that cannot be read (a write cut short
    by an older version, an edit by hand) is a RequestError that says how to start afresh."""
    if not path.exists():
        return []
    try:
        messages = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _unreadable_transcript(path, session, exc.strerror) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _unreadable_transcript(path, session, f"not JSON: {exc}") from exc
    except RecursionError as exc:  # arrays nested deeper than the parser's recursion limit
        raise _unreadable_transcript(path, session, "not JSON: nested too deeply") from exc
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in TRANSCRIPT_ROLES and isinstance(m.get("content"), str)
            for m in messages):
        raise _unreadable_transcript(path, session, "not a list of {role, content} messages with roles "
                                     + "/".join(TRANSCRIPT_ROLES))
    return messages


# what a transcript written by `generate --session` holds (a hand-edited role would reach the chat template,
# which may render it as text or fail inside jinja)
TRANSCRIPT_ROLES = ("system", "user", "assistant")


def _unreadable_transcript(path: Path, session: str, why: str) -> RequestError:
    return RequestError(f"session {session}: its transcript {path} cannot be read ({why}); "
                        "delete the file to start the conversation afresh")


def _write_transcript(path: Path, messages: list[dict[str, str]]) -> None:
    """Replace the transcript at once (a temporary file renamed over it): a process killed while
    writing, or a full disk, leaves the previous turn's transcript, never half of one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(messages))
    except OSError as exc:
        raise RequestError(f"cannot save the session's transcript {path}: {exc.strerror}; "
                           "this turn's answer is not part of the conversation") from exc


def _session_turn(llm: Any, args: argparse.Namespace, params: Any, transcript: Path,
                  history: list[dict[str, str]]) -> Any:
    """One turn of a stored conversation: its messages (text, for the chat template) live beside
    the session's KV; the engine reuses the KV of everything already said."""
    messages = [*history, {"role": "user", "content": args.prompt}]
    llm.enable_sessions(str(transcript.parent.parent))  # the sessions' directory: KV, and chats/
    if not history and llm.engine.sessions.conversation(args.session):
        # kept by `ask --session` or the server, which keep no transcript: this chat would replace it
        raise RequestError(f"session {args.session} holds a conversation that `generate` did not make (a RAG "
                           "session of `ask --session` or one of the server's): continue it there, or remove it "
                           f"with `ragfuse session rm {args.session}`")
    out = llm.chat(messages, params, args.system, session_id=args.session)
    llm.engine.sessions.close()  # the KV reaches disk before the process ends
    if not args.json:
        sys.stdout.write(out.text)
    _write_transcript(transcript, [*messages, {"role": "assistant", "content": out.text}])
    return out


def _usage_error(msg: str) -> int:
    sys.stderr.write(f"ragfuse: error: {msg}\n")
    return 2
