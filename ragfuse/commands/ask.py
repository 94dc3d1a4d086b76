"""``ragfuse ask``: retrieve from a store, fuse the chunks' stored KV, answer."""

from __future__ import annotations

import argparse
import json
import sys

from ragfuse.bench.report import speed_phrase
from ragfuse.commands.generate import add_model_args, positive_int, unit_ratio
from ragfuse.commands.ingest import add_store_arg
from ragfuse.store_dir import ingested_store


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="answer QUESTION from an ingested store, reusing its chunks' KV")
    p.add_argument("question")
    add_store_arg(p)
    add_model_args(p, store=True)
    p.add_argument("--mode", default="fuse", choices=["fuse", "full", "prefix", "reuse"],
                   help="fuse: stored chunk KV with selective recompute; reuse: stored KV as is; prefix: only "
                        "the instruction prefix's KV reused (prefix caching); full: full prefill")
    p.add_argument("--recompute-ratio", type=unit_ratio, default=None,
                   help="share of stored tokens to recompute (default: the loading controller's choice)")
    p.add_argument("--top-k", type=positive_int, default=5, help="chunks retrieved into the prompt")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens in the answer")
    p.add_argument("--redis", metavar="URL", help="also read KV from this Redis tier")
    p.add_argument("--compare", action="store_true",
                   help="also answer with full prefill and print both TTFTs (with --json: under 'compare')")
    p.add_argument("--session", metavar="ID",
                   help="continue conversation ID: its history's KV is reused, this question follows it as the next "
                        "user message (chunks the history holds are not repeated), and the turn joins it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the user's mistakes are told before the engine (seconds of imports and loading) starts
    if not args.question.strip():
        raise _usage("QUESTION is empty")
    if args.compare and args.session is not None:  # the baseline is the question alone, which the turn is not
        raise _usage("--compare answers the question alone with full prefill, while a --session turn follows "
                     "its history: the two would not be the same prompt (use one or the other)")
    if args.redis is not None:  # (imports torch: only when asked for)
        from ragfuse.engine.kvstore import check_redis

        check_redis(args.redis)
    _check_has_chunks(args.store)
    if args.session is not None:
        from ragfuse.engine.sessions import check_session_id

        check_session_id(args.session)
    from ragfuse.app import open_pipeline
    from ragfuse.engine import SamplingParams

    # the accuracy gate's r* (a one-off calibration of minutes on a CPU) only bounds a ratio nobody chose
    gate = args.mode == "fuse" and args.recompute_ratio is None
    held = None
    if args.session is not None:  # a server keeping the store's sessions is told before the model loads
        from ragfuse.engine.sessions.store import hold_sessions
        from ragfuse.store_dir import resolve_store_dir

        held = hold_sessions(resolve_store_dir(args.store) / "sessions")
    pipe = None
    try:
        pipe = open_pipeline(args.store, args.model, args.device, args.dtype, redis_url=args.redis, gate=gate)
        if held is not None:
            from ragfuse.engine.sessions import SessionStore

            eng = pipe.engine
            eng.enable_sessions(SessionStore(held.path.parent, eng.fingerprint, eng.dtype, hold=held))
        params = SamplingParams(max_tokens=args.max_tokens)
        result = None
        for item in pipe.stream(args.question, mode=args.mode, ratio=args.recompute_ratio, top_k=args.top_k,
                                params=params, session_id=args.session):
            if hasattr(item, "delta_text"):
                if not args.json:
                    sys.stdout.write(item.delta_text)
                    sys.stdout.flush()
            else:
                result = item
    finally:  # the turn's KV reaches disk before the process ends, and the sessions are free again
        if pipe is not None and pipe.engine.sessions is not None:
            pipe.engine.sessions.close()
        if held is not None:
            held.release()
    assert result is not None
    baseline = None
    if args.compare and args.mode != "full":
        baseline = pipe.ask(args.question, mode="full", top_k=args.top_k, params=params)
    if args.json:
        out = result.as_dict()
        if baseline is not None:
            out["compare"] = {"full": baseline.as_dict(), "ttft_speedup": baseline.ttft_s / result.ttft_s}
        print(json.dumps(out))
        return 0
    print()
    print("\nsources:")
    for s in result.sources:
        print(f"  [{s['score']:.3f}] {s['source']}: {s['text'][:90].replace(chr(10), ' ')}...")
    print(f"\nmode {result.mode}, recomputed {result.recompute_ratio:.0%} of stored tokens, "
          f"TTFT {result.ttft_s * 1e3:.0f} ms, KV from {', '.join(result.tiers) or 'nowhere (full prefill)'}")
    if baseline is not None:
        print(f"full prefill: TTFT {baseline.ttft_s * 1e3:.0f} ms -> {args.mode} is "
              f"{speed_phrase(baseline.ttft_s / result.ttft_s, 1)} to the first token "
              f"(answers {'match' if baseline.answer == result.answer else 'differ'})")
        if baseline.answer != result.answer:
            print(f"full prefill's answer: {baseline.answer}")
    if result.session is not None:
        s = result.session
        print(f"session {args.session}: {s['session_tokens_reused']} history tokens reused from "
              f"{s['session_tier'] or 'nowhere (new or recomputed)'}, {s['prefilled_tokens']} prefilled")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _check_has_chunks(store: str | None) -> None:
    """Refuse a store without a single chunk (its ingest found nothing to read, or `store rm` removed
    everything) before the engine loads: the accuracy gate's first calibration alone takes minutes."""
    from ragfuse.docstore import DocStore
    from ragfuse.store_dir import StoreError

    root, _ = ingested_store(store)
    docs = DocStore(root / "docstore.sqlite", read_only=True)  # a look: it creates nothing, works read-only
    try:
        empty = docs.counts()["chunks"] == 0
    finally:
        docs.close()
    if empty:
        raise StoreError(f"the store at {root} has no documents: run `ragfuse ingest` first")


def _usage(msg: str) -> SystemExit:
    sys.stderr.write(f"ragfuse: error: {msg}\n")
    return SystemExit(2)
