"""``ragfuse bench vllm``: time to first token of vLLM alone vs vLLM with ragfuse's connector.

Two workloads, both engines in one run on the default model (vLLM's own prefix cache off in both,
so every reuse measured is the connector's):
- **session**: a chat's second turn (turn 1 = system + a long user message, its greedy answer, then a
  follow-up). With the connector, turn 1's prompt was saved while it ran; turn 2 loads it (from the
  worker's memory tier, where the save put it).
- **rag**: MuSiQue questions over ``--passages`` retrieved passages, each a chunk whose KV was stored
  beforehand (as ``ragfuse ingest`` would; here computed by vLLM itself), the system header stored
  by a warm-up request; then a fresh engine reads them from the disk tier, page cache dropped. The
  chunks are loaded at their positions in **full-reuse mode** (re-positioned stored KV, no
  selective recompute): the quality columns say what that costs
  against vLLM alone (first-token top-1 agreement, first-token KL over the top-20 logprobs, greedy
  answer agreement, answer F1 against the gold answers for both).

TTFT is the wall time of a one-token generation through ``LLM.generate``, after a warm-up request.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ragfuse.shared_data import shared_data

from .args import positive_int
from .partial import Report

DATA = shared_data("musique_dev.json")
SESSION_USER = (
    "Here is a report I am working on. Please read it carefully, I will ask questions about it.\n\n{doc}"
)


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("vllm", help="TTFT of vLLM alone vs vLLM with ragfuse's KV connector (session, RAG)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model both vLLM engines load")
    p.add_argument("--data", default=str(DATA), help="MuSiQue-style JSON: ctxs[].text, question, answers")
    p.add_argument("--cases", type=positive_int, default=6, help="RAG questions (and session documents)")
    p.add_argument("--passages", type=positive_int, default=3, help="passages (chunks) per RAG prompt")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="greedy answer length for the quality columns")
    p.add_argument("--store", help="KV store directory for the connector (default: a fresh temporary one)")
    p.add_argument("--out", default="bench-results/vllm", help="output folder (default bench-results/vllm)")
    p.set_defaults(func=run)


def _f1(pred: str, gold: list[str]) -> float:
    def toks(s: str) -> list[str]:
        return re.sub(r"[^a-z0-9 ]", " ", s.lower()).split()

    best = 0.0
    for g in gold:
        common = Counter(toks(pred)) & Counter(toks(g))
        n = sum(common.values())
        if n:
            p, r = n / len(toks(pred)), n / len(toks(g))
            best = max(best, 2 * p * r / (p + r))
    return best


def _kl_top(p_lp: dict[int, float], q_lp: dict[int, float]) -> float:
    """KL(p || q) over p's top-k tokens, both renormalised there; a token missing from q's top-k gets
    q's smallest listed probability (an upper-bound-ish estimate, stated in the notes)."""
    floor = min(q_lp.values())
    ps = {t: math.exp(v) for t, v in p_lp.items()}
    qs = {t: math.exp(q_lp.get(t, floor)) for t in p_lp}
    zp, zq = sum(ps.values()), sum(qs.values())
    return sum(p / zp * math.log((p / zp) / (qs[t] / zq)) for t, p in ps.items())


def _load_cases(path: str, n: int, passages: int) -> list[dict[str, Any]]:
    from ragfuse.engine.errors import RagfuseError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RagfuseError(f"cannot read benchmark data {path}: {exc}") from exc
    return [{"question": d["question"], "answers": d["answers"],
             "passages": [c["text"] for c in d["ctxs"][:passages]]} for d in data[:n]]


def _session_turns(backend: Any, doc: str, answer: str | None) -> tuple[Any, list[dict[str, str]]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": SESSION_USER.format(doc=doc)}]
    if answer is None:
        return backend.chat_prompt(msgs), msgs
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Summarise it in one sentence."}]
    return backend.chat_prompt(msgs), msgs


def _warm_up(backend: Any) -> None:
    """The first requests of a fresh engine pay one-off costs; keep them out of the timings."""
    backend.generate(backend.rag_prompt("What is this?", ["A warm-up passage about nothing in particular."]),
                     max_tokens=2)


def _session(backend: Any, cases: list[dict[str, Any]], part: str) -> dict[str, list]:
    """Turn 2 TTFT of one chat per case (turn 1: a document of two passages, answered greedily); progress
    on stderr under ``part``'s name."""
    out: dict[str, list] = {"session_ttft": [], "session_loaded": []}
    for case in tqdm(cases, desc=f"{part}: sessions"):
        doc = "\n\n".join(case["passages"][:2])
        turn1, _ = _session_turns(backend, doc, None)
        answer = backend.generate(turn1, max_tokens=24).text
        turn2, _ = _session_turns(backend, doc, answer)
        g = backend.generate(turn2, max_tokens=1)
        out["session_ttft"].append(g.seconds)
        out["session_loaded"].append((g.connector or {}).get("loaded_tokens", 0))
    return out


def _ingest(backend: Any, cases: list[dict[str, Any]]) -> None:
    """What ``ragfuse ingest`` does ahead of queries: every chunk's KV computed alone and stored; the
    RAG system header stored by one request on other passages."""
    chunks = [backend.rag_prompt(c["question"], c["passages"]).chunk_token_ids for c in cases]
    backend.store_chunks([t for ids in chunks for t in ids])
    backend.generate(backend.rag_prompt("Warm-up question?", ["Another warm-up passage."]), max_tokens=1)


def _rag(backend: Any, cases: list[dict[str, Any]], max_tokens: int, part: str) -> dict[str, list]:
    """RAG TTFTs, then answers and first-token logprobs (after timing, so a timed request never finds
    a tail saved by an earlier request of the same prompt); progress on stderr under ``part``'s name."""
    out: dict[str, list] = {"rag_ttft": [], "rag_loaded": [], "rag_hits": [], "answers": [], "first": [],
                            "prompt_tokens": []}
    for case in tqdm(cases, desc=f"{part}: RAG TTFT"):
        g = backend.generate(backend.rag_prompt(case["question"], case["passages"]), max_tokens=1)
        out["rag_ttft"].append(g.seconds)
        out["rag_loaded"].append((g.connector or {}).get("loaded_tokens", 0))
        out["rag_hits"].append((g.connector or {}).get("chunk_hits", 0))
    for case in tqdm(cases, desc=f"{part}: RAG answers"):
        prompt = backend.rag_prompt(case["question"], case["passages"])
        g = backend.generate(prompt, max_tokens=max_tokens, logprobs=20)
        out["answers"].append(g.text)
        out["first"].append(g.first_logprobs or {})
        out["prompt_tokens"].append(len(prompt.token_ids))
    return out


def _drop_page_cache(store: str) -> None:
    """Make the RAG pass read entries from the disk itself, not from the OS page cache."""
    from ragfuse.engine.kvstore.disk import drop_page_cache

    for f in Path(store).rglob("*.safetensors"):
        drop_page_cache(f)


def _table(results: dict[str, dict[str, Any]], cases: list[dict[str, Any]], mode: str, report: Report) -> None:
    """The rows of the workloads both engines ran (all of them, unless a Ctrl-C stopped the run) and,
    once both answered the RAG questions, the quality row, into ``report``; ``mode``: the connector's
    for chunks."""
    base, conn = results["vllm"], results["vllm+ragfuse"]
    med = statistics.median
    for workload in ("session", "rag"):
        if f"{workload}_ttft" not in base or f"{workload}_ttft" not in conn:
            continue
        b, c = med(base[f"{workload}_ttft"]), med(conn[f"{workload}_ttft"])
        report.rows.append({"workload": workload, "vllm_ttft_s": b, "vllm+ragfuse_ttft_s": c, "speedup": b / c,
                            "loaded_tokens_median": med(conn[f"{workload}_loaded"]),
                            "mode": "exact (prefix)" if workload == "session" else mode,
                            "tier": "memory" if workload == "session" else "disk (page cache dropped)"})
    if "answers" not in base or "answers" not in conn:
        return
    top1 = [max(b, key=b.get) == max(c, key=c.get) for b, c in zip(base["first"], conn["first"]) if b and c]
    kls = [_kl_top(b, c) for b, c in zip(base["first"], conn["first"]) if b and c]
    quality = {
        "mode": mode, "cases": len(cases),
        "first_token_top1_agreement": sum(top1) / len(top1) if top1 else None,
        "first_token_kl_top20_mean": statistics.fmean(kls) if kls else None,
        "answer_agreement": statistics.fmean(a == b for a, b in zip(base["answers"], conn["answers"])),
        "f1_vllm": statistics.fmean(_f1(a, c["answers"]) for a, c in zip(base["answers"], cases)),
        "f1_vllm+ragfuse": statistics.fmean(_f1(a, c["answers"]) for a, c in zip(conn["answers"], cases)),
        "chunk_hits_per_prompt": med(conn["rag_hits"]),
        "prompt_tokens_median": med(conn["prompt_tokens"]),
    }
    report.results["quality"] = quality
    report.rows.append({"workload": "rag quality", **{k: v for k, v in quality.items() if k not in ("cases",)}})


def run(args: argparse.Namespace) -> int:
    from ragfuse.bench.report import machine_info
    from ragfuse.connectors.vllm.backend import compute_dtype, import_vllm
    from ragfuse.engine.errors import RagfuseError

    vllm = import_vllm()  # a clear RagfuseError (exit 2) when vLLM is not installed
    if args.cases < 1 or args.passages < 1:
        raise RagfuseError("--cases and --passages must be at least 1")
    from ragfuse.connectors.vllm.backend import VLLMBackend
    from ragfuse.connectors.vllm.connector import MODE

    cases = _load_cases(args.data, args.cases, args.passages)
    store = args.store or tempfile.mkdtemp(prefix="ragfuse-vllm-bench-")
    results: dict[str, dict[str, Any]] = {"vllm": {}, "vllm+ragfuse": {}}
    # 1. vLLM alone; 2. with the connector: sessions (turn 1 saved while it runs, turn 2 loads it from the
    # worker's memory tier) and ingest; 3. a fresh engine with the connector: RAG with every entry read
    # from the disk tier with the page cache dropped, as when chunks were ingested by another process.
    parts = ["vLLM alone: session and RAG", "with the connector: session and ingest", "with the connector: RAG"]
    stages = [(False, lambda b: {**_session(b, cases, parts[0]), **_rag(b, cases, args.max_tokens, parts[0])},
               "vllm"),
              (True, lambda b: {**_session(b, cases, parts[1]), **(_ingest(b, cases) or {})}, "vllm+ragfuse"),
              (True, lambda b: _rag(b, cases, args.max_tokens, parts[2]), "vllm+ragfuse")]

    def plot(fig: Any) -> None:
        rows = report.rows
        ax = fig.add_subplot(1, 1, 1)
        names = ["session turn 2", "RAG, stored chunks"]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [rows[0]["vllm_ttft_s"], rows[1]["vllm_ttft_s"]], 0.4, label="vLLM")
        ax.bar([i + 0.2 for i in x], [rows[0]["vllm+ragfuse_ttft_s"], rows[1]["vllm+ragfuse_ttft_s"]], 0.4,
               label=f"vLLM + ragfuse connector ({MODE} for chunks)")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("median TTFT (s)")
        ax.legend()

    notes = (
        f"vLLM {vllm.__version__} on CPU, {compute_dtype()}, the default model, vLLM prefix caching off in both "
        "engines. "
        f"{len(cases)} MuSiQue cases, {args.passages} passages per RAG prompt. Non-prefix chunks run in "
        f"**{MODE}** mode: their stored KV (computed alone) is re-positioned, never recomputed, because a "
        "vLLM connector sees the paged KV cache but not the hidden states selective recompute needs. "
        "Session history is loaded exactly (greedy output equals vLLM alone; tested). KL is over vLLM "
        "alone's top-20 first-token logprobs, renormalised, tokens missing from the other top-20 floored."
    )
    report = Report(args.out, "vLLM alone vs vLLM + ragfuse connector", {
        "machine": machine_info("cpu"), "vllm": vllm.__version__, "raw": results,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }, parts, plot=plot, notes=notes)
    with report.interruptible():
        try:
            for (with_connector, stage, name), part in zip(stages, parts, strict=True):
                report.begin(part)
                backend = VLLMBackend(args.model, store_dir=store, connector=with_connector)
                try:
                    _warm_up(backend)
                    if name == "vllm+ragfuse" and "session_ttft" in results[name]:
                        _drop_page_cache(store)
                    results[name].update(stage(backend))
                finally:
                    backend.close()
        finally:  # every workload, or those both engines finished before a Ctrl-C
            _table(results, cases, MODE, report)
    report.write()
    print(f"wrote {args.out}/results.md")
    for r in report.rows:
        print(r)
    return 0
