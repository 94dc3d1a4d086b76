"""``ragfuse bench server-reuse``: what sessions and relay save a client of ``ragfuse serve``.

Starts ``ragfuse serve`` in its own process (an empty store in a temporary directory), then, side
by side in one run, through the HTTP API as a client uses it (streaming chat completions, greedy):

- sessions: ShareGPT conversations (``../shared/data/sharegpt_multiturn_dev.jsonl``) replayed turn
  by turn, each turn sent twice: as a turn of a session (its history KV reused from the session
  store) and stateless (the same messages, no ``session_id``). The model's own answers are the
  assistant turns, as a chat client sends them back. Reported per turn: TTFT both ways, tokens the
  session reused, tokens the stateless request found in the engine's prefix cache anyway, and
  whether the answers are the same.
- relay: questions behind one long system message, each sent with relay on and off (``"relay"``).

TTFT is what the client sees (request sent to the first content chunk). The server runs without
its prefix tree (``--no-prefix-tree``) unless ``--prefix-tree``: the baselines are then what they
say, full prefill of the history and of the system prompt (the prefix tree would otherwise serve
them from blocks a single client's earlier requests left in memory, which a busy server evicts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ragfuse.shared_data import shared_data

from .partial import Report
from .report import machine_info
from .serve_process import served

SHAREGPT = shared_data("sharegpt_multiturn_dev.jsonl")
MUSIQUE = shared_data("musique_dev.json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server-reuse", help="ragfuse serve: TTFT of session turns vs stateless, relay on vs off")
    p.add_argument("--conversations", type=int, default=3, help="sessions: ShareGPT conversations replayed")
    p.add_argument("--turns", type=int, default=4, help="turns replayed per conversation")
    p.add_argument("--message-chars", type=int, default=600, help="each user message cut to this many characters")
    p.add_argument("--questions", type=int, default=6, help="questions behind the system message (relay)")
    p.add_argument("--system-chars", type=int, default=4000, help="length of the system message (relay)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model the server loads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the server runs the model (auto: CUDA when available, else CPU)")
    p.add_argument("--prefix-tree", action="store_true", help="keep the engine's prefix tree on (see above)")
    p.add_argument("--out", default="bench-results/server-reuse",
                   help="output folder (default bench-results/server-reuse)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine.errors import RagfuseError

    if min(args.conversations, args.turns, args.message_chars, args.questions, args.system_chars,
           args.max_tokens) < 1:
        raise RagfuseError("counts and lengths must be positive")
    conversations = _conversations(args.conversations, args.turns, args.message_chars)
    key = secrets.token_hex(16)
    turns: list[dict[str, Any]] = []
    relays: list[dict[str, Any]] = []
    report = Report(args.out, "ragfuse bench server-reuse",
                    {"machine": machine_info(args.device), "turns": turns, "relay": relays}, ["sessions", "relay"],
                    plot=lambda fig: _plot(fig, report.rows), notes=lambda: _notes(args, turns, relays))
    with report.interruptible():
        try:
            with tempfile.TemporaryDirectory(prefix="ragfuse-bench-reuse-") as tmp:
                serve_args = ["--store", str(Path(tmp) / "store"), "--model", args.model, "--device", args.device,
                              "--no-gate", "--log-level", "warning",
                              *([] if args.prefix_tree else ["--no-prefix-tree"])]
                with served(serve_args, key, Path(tmp)) as server:
                    asyncio.run(_drive(server.url, key, conversations, args, report, turns, relays))
        finally:  # every turn and question, or those finished before a Ctrl-C
            report.rows += _rows(args, turns, relays)
    path = report.write()
    for r in report.rows:
        print(f"{r['part']} {r['turn'] or ''}: TTFT {r['ttft_session_s']:.3f} s vs {r['ttft_stateless_s']:.3f} s "
              f"({r['speedup']:.2f}x), reused {r['session_reused_tokens']:.0f} of {r['prompt_tokens']:.0f} tokens, "
              f"same answers {r['same_answers']}/{r['n']}")
    print(f"-> {path}")
    return 0


def _conversations(count: int, turns: int, chars: int) -> list[list[str]]:
    """The user messages of the first ``count`` conversations with at least ``turns`` of them."""
    out = []
    with SHAREGPT.open() as f:
        for line in f:
            msgs = [m["value"][:chars] for m in json.loads(line)["conversations"] if m["from"] == "human"]
            if len(msgs) >= turns and all(m.strip() for m in msgs[:turns]):
                out.append(msgs[:turns])
                if len(out) == count:
                    break
    return out


async def _drive(url: str, key: str, conversations: list[list[str]], args: argparse.Namespace, report: Report,
                 turns: list[dict[str, Any]], relays: list[dict[str, Any]]) -> None:
    """Both parts, each pair of requests appended to ``turns`` or ``relays`` once both came back."""
    import httpx

    total = len(conversations) * args.turns + args.questions
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as http:
        await _chat(http, args, [{"role": "user", "content": "Hello."}], {})  # warm-up (not counted)
        with tqdm(total=total, desc="bench server-reuse") as bar:
            report.begin("sessions")
            for c, users in enumerate(conversations):
                messages: list[dict[str, str]] = []
                for t, text in enumerate(users):
                    messages.append({"role": "user", "content": text})
                    session = await _chat(http, args, messages, {"session_id": f"bench-{c}"})
                    stateless = await _chat(http, args, messages, {})
                    turns.append({"conversation": c, "turn": t + 1, "session": session, "stateless": stateless})
                    messages.append({"role": "assistant", "content": session["text"]})
                    bar.update(1)
            report.begin("relay")
            system = _system_text(args.system_chars)
            for q in range(args.questions):
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"Question {q + 1}: name one place the passages mention."}]
                off = await _chat(http, args, messages, {"relay": False})
                on = await _chat(http, args, messages, {"relay": True})
                relays.append({"question": q + 1, "relay": on, "no_relay": off})
                bar.update(1)


def _system_text(chars: int) -> str:
    with MUSIQUE.open() as f:
        cases = json.load(f)
    text = "Answer from these passages.\n" + "\n".join(p["text"] for case in cases[:4] for p in case["ctxs"])
    return text[:chars]


async def _chat(http: Any, args: argparse.Namespace, messages: list[dict[str, str]],
                extra: dict[str, Any]) -> dict[str, Any]:
    """One streaming greedy chat completion: its TTFT, text and usage."""
    body = {"model": args.model, "stream": True, "max_tokens": args.max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": messages, **extra}
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(event["choices"][0]["delta"]["content"])
            usage = event.get("usage") or usage
    return {"ttft_s": (first or time.perf_counter()) - start, "text": "".join(text), "usage": usage}


def _compare(part: str, turn: int | None, pairs: list[dict[str, Any]], reuse: str, plain: str, reused_key: str
             ) -> dict[str, Any]:
    """One table row: medians over request pairs sent with reuse (``reuse``) and without (``plain``)."""
    med = statistics.median
    on, off = med(x[reuse]["ttft_s"] for x in pairs), med(x[plain]["ttft_s"] for x in pairs)
    return {
        "part": part, "turn": turn, "n": len(pairs),
        "prompt_tokens": med(x[reuse]["usage"]["prompt_tokens"] for x in pairs),
        "ttft_session_s": on, "ttft_stateless_s": off, "speedup": off / on,
        "session_reused_tokens": med(x[reuse]["usage"]["ragfuse"][reused_key] for x in pairs),
        "stateless_prefix_cached_tokens": med(x[plain]["usage"]["prompt_tokens_details"]["cached_tokens"]
                                              for x in pairs),
        "same_answers": sum(x[reuse]["text"] == x[plain]["text"] for x in pairs),
    }


def _rows(args: argparse.Namespace, turns: list[dict[str, Any]], relays: list[dict[str, Any]]
          ) -> list[dict[str, Any]]:
    """The table: a row per turn number and one for relay, each from the pairs that finished."""
    rows = [
        _compare("sessions", t, pairs, "session", "stateless", "session_tokens_reused")
        for t in range(1, args.turns + 1) if (pairs := [x for x in turns if x["turn"] == t])
    ]
    if relays:
        rows.append(_compare("relay", None, relays, "relay", "no_relay", "relay_system_tokens"))
    return rows


def _notes(args: argparse.Namespace, turns: list[dict[str, Any]], relays: list[dict[str, Any]]) -> str:
    """What the rows are, with the numbers of conversations and questions that ran (fewer after a Ctrl-C)."""
    tree = "on" if args.prefix_tree else "off (baselines are full prefill)"
    return (f"`ragfuse serve` ({args.model}, {args.device}), prefix tree {tree}, greedy, {args.max_tokens} tokens "
            "per answer, medians. "
            f"Sessions rows: {len(turns) // max(args.turns, 1)} ShareGPT conversations, each turn sent as a session "
            "turn (`ttft_session_s`, `session_reused_tokens`: history KV from the session store) and stateless "
            "(`ttft_stateless_s`; `stateless_prefix_cached_tokens`: blocks the engine's prefix tree still held). "
            f"Relay row: {len(relays)} questions behind one system message, `ttft_session_s` with relay, "
            "`ttft_stateless_s` without (the prefix tree may still share its blocks), `session_reused_tokens`: "
            "system tokens relay served. `same_answers`: identical greedy text both ways. Turn 1 is the same "
            "request twice (nothing is stored yet).")


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    turns = [r for r in rows if r["part"] == "sessions"]
    xs = [r["turn"] for r in turns]
    ax1.plot(xs, [r["ttft_stateless_s"] for r in turns], marker="o", label="stateless")
    ax1.plot(xs, [r["ttft_session_s"] for r in turns], marker="o", label="session (history KV reused)")
    ax1.set(xlabel="turn", ylabel="median TTFT (s)", title="multi-turn chat through the server")
    ax1.legend()
    (relay,) = [r for r in rows if r["part"] == "relay"]
    ax2.bar(["no relay", "relay"], [relay["ttft_stateless_s"], relay["ttft_session_s"]])
    ax2.set(ylabel="median TTFT (s)", title=f"behind a {relay['prompt_tokens']:.0f}-token prompt")
