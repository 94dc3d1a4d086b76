"""``ragfuse eval qa``: fusion modes against full prefill on multi-hop QA (CacheBlend's datasets).

Each example's passages are stored alone (as ingest stores chunks), then fused in the given order
behind the instruction prefix, with the question last. Every mode runs one fused prefill; on that
cache it is scored teacher-forced along full prefill's own answer (``kl_tf``: one early difference
does not compound), then it answers greedily (``agreement``, ``f1_full``, ``f1``).

The baseline modes (LangChain's MapReduce and MapRerank chains, ``ragfuse.baselines``) never build
one prompt of all passages, so they have no KL; they are scored on their answers and TTFT only.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import string
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ragfuse.engine import LLMEngine, RagfuseError
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import Case, build_case, kl_rows

FUSION_MODES = ("full", "prefix", "reuse", "fuse", "fuse-paper")
# full prefill's own KV rounded to bfloat16, then reused: no fusion at all, only the rounding every bf16
# deployment applies to exact KV; its row is the noise floor the fusion modes' distances are read against
NOISE_MODE = "full-bf16kv"
BASELINE_MODES = ("mapreduce", "maprerank")
# what results.json keeps of each case's run of each mode: enough to inspect answers and re-slice the figures
CASE_FIELDS = ("answer", "kl_first", "kl_tf", "ttft_s", "recompute_ratio")
SWEEP = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# a reuse kl_tf below this is float32 rounding, not a gap (an exact reuse measures ~1e-9 to 1e-8 on CPU; the
# bf16 noise floor is ~1.5e-5, real reuse gaps ~0.1): gap_closed there would be a ratio of two noises
NO_GAP_KL = 1e-6


@dataclass
class Example:
    passages: list[str]
    question: str
    answers: list[str]


def load_dataset(path: str | Path, limit: int | None, max_passages: int | None) -> list[Example]:
    """CacheBlend's format: ``[{ctxs: [{title, text}], question, answers}]``; ``answers`` is a list
    of strings or a list of lists of strings (aliases of one answer). JSON Lines (one example a line)
    is read too. Every example used is checked here, before any model loads: a malformed one found
    only when its turn comes would cost the run made so far."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise RagfuseError(f"cannot read dataset {path}: {exc}") from exc
    if not text.strip():
        raise RagfuseError(f"dataset {path} is empty")
    raw = _parse_examples(path, text)
    if not isinstance(raw, list) or not raw:
        raise RagfuseError(f"{path}: expected a non-empty JSON list of examples")
    out = []
    for i, ex in enumerate(raw[:limit] if limit else raw):
        try:
            out.append(_example(ex, max_passages))
        except ValueError as exc:
            raise RagfuseError(f"{path}: example {i}: {exc}") from exc
    return out


def _parse_examples(path: str | Path, text: str) -> Any:
    """The file's JSON value; for JSON Lines, the list of its lines' values (a one-line file parses as
    a single object, which is taken as a list of one)."""
    try:
        raw = json.loads(text)
    except ValueError as whole:
        lines = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip()]
        try:
            first_is_object = isinstance(json.loads(lines[0][1]), dict)
        except ValueError:
            first_is_object = False
        if not first_is_object:
            raise RagfuseError(f"cannot read dataset {path}: not JSON ({whole})") from whole
        raw = []
        for n, line in lines:
            try:
                raw.append(json.loads(line))
            except ValueError as exc:
                raise RagfuseError(f"cannot read dataset {path}: line {n} is not JSON ({exc})") from exc
        return raw
    return [raw] if isinstance(raw, dict) and "question" in raw else raw


def _example(ex: Any, max_passages: int | None) -> Example:
    """One dataset entry as an ``Example``; ValueError says what is wrong with it."""
    if not isinstance(ex, dict):
        raise ValueError(f"expected an object with ctxs/question/answers, got {type(ex).__name__}")
    missing = [k for k in ("ctxs", "question", "answers") if k not in ex]
    if missing:
        raise ValueError(f"lacks {'/'.join(missing)} (each example needs ctxs/question/answers)")
    ctxs = ex["ctxs"]
    if not isinstance(ctxs, list) or not ctxs:
        raise ValueError("ctxs must be a non-empty list of {title, text} passages")
    passages = []
    for j, c in enumerate(ctxs[:max_passages] if max_passages else ctxs):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str) \
                or not isinstance(c.get("title") or "", str):
            raise ValueError(f"ctxs[{j}] must be an object with a string text (and an optional string title)")
        passages.append(f"{c.get('title') or ''}\n{c['text']}".strip())
    question = ex["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    answers = _answers(ex["answers"])
    if not any(a.strip() for a in answers):
        raise ValueError("answers holds no answer (F1 against the gold answers would be undefined)")
    return Example(passages, question, answers)


def _answers(value: Any) -> list[str]:
    """Gold answers flattened: a string, or a list of answers each a string (a number is read as its
    text) or a list of such aliases. A bare string is one answer, never its characters."""
    def one(a: Any) -> str:
        if isinstance(a, str):
            return a
        if isinstance(a, int | float) and not isinstance(a, bool):
            return str(a)
        raise ValueError(f"answers must be strings, numbers or lists of them, got {json.dumps(a)}")

    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"answers must be a list, got {type(value).__name__}")
    return [one(a) for group in value for a in (group if isinstance(group, list) else [group])]


def normalize(text: str) -> str:
    """SQuAD-style answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    p, r = normalize(prediction).split(), normalize(reference).split()
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r:
        return float(p == r)
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def policy_for(mode: str, ratio: float, ours: SelectionPolicy) -> tuple[str, SelectionPolicy]:
    """(engine mode, selection policy) of an eval mode name."""
    if mode == "fuse-paper":
        return "fuse", SelectionPolicy.paper(ratio)
    return mode, ours.with_ratio(ratio)


@torch.inference_mode()
def run_mode(
    engine: LLMEngine, case: Case, mode: str, policy: SelectionPolicy, max_tokens: int
) -> dict[str, Any]:
    """One fused prefill: teacher-forced KL along full's answer, then the mode's own greedy answer."""
    runner = engine.runner
    prompt = [t for s in case.segments for t in s.token_ids]
    n = len(prompt)
    with engine.borrowed_blocks([prompt + [0] * max(max_tokens, len(case.answer_ids))]) as (table,):
        first, stats = runner.fused_prefill(table, case.segments, mode, policy)
        teacher = case.answer_ids[:-1]
        rest = runner.model.compute_logits(runner.forward_continuation(teacher, n, table)) if teacher else None
        logits = first[None] if rest is None else torch.cat([first[None], rest])
        kls = kl_rows(case.full_logits, logits)
        answer = [int(first.argmax())]
        while len(answer) < max_tokens and answer[-1] not in engine.eos_token_ids:
            h = runner.forward_continuation(answer[-1:], n + len(answer) - 1, table)
            answer.append(int(runner.model.compute_logits(h)[0].argmax()))
    answer = [t for t in answer if t not in engine.eos_token_ids]
    return {
        "kl_first": float(kls[0]), "kl_tf": float(kls.mean()), "answer_ids": answer,
        "answer": engine.tokenizer.decode(answer, skip_special_tokens=True).strip(),
        "ttft_s": stats.total_s, "recompute_ratio": stats.recompute_ratio, "prompt_tokens": stats.prompt_tokens,
    }


def rounded_full_case(engine: LLMEngine, case: Case, dtype: torch.dtype = torch.bfloat16) -> Case:
    """``case`` as one stored segment holding full prefill's own KV of all but the prompt's last token,
    rounded to ``dtype`` (then back to the engine's dtype), and that last token computed: reusing it
    changes nothing but the rounding, so it measures how much the measures move for a perturbation far
    below any fusion error."""
    prompt = [t for s in case.segments for t in s.token_ids]
    # a second full prefill: the case's own ran in borrowed blocks that are gone, and keeping every
    # case's whole-prompt KV for a mode few runs ask for would cost memory in every eval
    ((k, v),) = engine.compute_kv([prompt[:-1]])
    kv = TensorKV(k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype))
    return Case([Segment(prompt[:-1], kv, "prompt"), Segment(prompt[-1:], None, "last token")],
                case.answer_ids, case.full_logits)


def full_row(engine: LLMEngine, case: Case) -> dict[str, Any]:
    """Full prefill's row from the case itself: building the case ran that very prefill and greedy
    answer (the reference every other mode is scored against), so running it again would only
    repeat the most expensive mode of the eval to measure a KL that is zero by definition."""
    stats = case.full_stats
    assert stats is not None
    return {
        "kl_first": 0.0, "kl_tf": 0.0, "answer_ids": case.answer_ids,
        "answer": engine.tokenizer.decode(case.answer_ids, skip_special_tokens=True).strip(),
        "ttft_s": stats.total_s, "recompute_ratio": stats.recompute_ratio, "prompt_tokens": stats.prompt_tokens,
    }


def baseline_chains(engine: LLMEngine, max_tokens: int) -> Any:
    """LangChain's chains over ``engine`` (imported here: LangChain is an optional extra)."""
    try:
        from ragfuse.baselines import BaselineChains
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith(("langchain", "pydantic")):
            raise
        raise RagfuseError(f"modes {', '.join(BASELINE_MODES)} need LangChain: pip install 'ragfuse[langchain]'") \
            from exc
    return BaselineChains(engine, max_tokens=max_tokens)


def run_baseline(chains: Any, example: Example, mode: str) -> dict[str, Any]:
    """One LangChain chain on the example's passages; no KL (there is no single prompt to score)."""
    r = chains.run(mode, example.passages, example.question)
    return {
        "kl_first": None, "kl_tf": None, "answer": r.answer, "ttft_s": r.ttft_s,
        "recompute_ratio": 1.0,  # every passage is prefilled anew, in its own prompt
        "prompt_tokens": r.prompt_tokens, "llm_calls": r.llm_calls,
    }


def summarize(per_case: list[dict[str, Any]], reuse_kl: float | None) -> dict[str, float | None]:
    """One mode's figures over its cases. ``gap_closed`` (the share of reuse's ``kl_tf`` this mode
    removes) is None where it is undefined: no reuse row to measure the gap by, or a reuse already
    exact (``kl_tf`` 0 up to rounding, below ``NO_GAP_KL``, as for a one-passage prompt whose passage
    KV was stored after the prefix). It was NaN there (invalid JSON) or, with reuse's rounding noise
    as the divisor, any number at all (-1.7 for a fuse as exact as reuse)."""
    n = len(per_case)
    f1_full = [token_f1(r["answer"], r["full_answer"]) for r in per_case]
    kl_tf = None if per_case[0]["kl_tf"] is None else sum(r["kl_tf"] for r in per_case) / n
    return {
        "kl_first": None if kl_tf is None else sum(r["kl_first"] for r in per_case) / n,
        "kl_tf": kl_tf,
        "gap_closed": None if kl_tf is None or reuse_kl is None or reuse_kl < NO_GAP_KL else 1.0 - kl_tf / reuse_kl,
        "agreement": sum(normalize(r["answer"]) == normalize(r["full_answer"]) for r in per_case) / n,
        "f1_full": sum(f1_full) / n,
        # per-case f1_full is nearly two-valued (same answer or a different one), so 20 cases leave its mean
        # uncertain by several points: the standard error says how far apart two rows must be to differ
        "f1_full_se": statistics.stdev(f1_full) / math.sqrt(n) if n > 1 else None,
        "f1": sum(max(token_f1(r["answer"], a) for a in r["gold"]) for r in per_case) / n,
        "ttft_s": sum(r["ttft_s"] for r in per_case) / n,
        "recompute_ratio": sum(r["recompute_ratio"] for r in per_case) / n,
        "n": n,
    }


def parse_modes(text: str, allowed: Iterable[str]) -> list[str]:
    """Comma-separated mode names in their given order, each once (a repeated name would run the
    mode twice and count each case twice in its row). RagfuseError names the unknown ones, so a
    command line can be checked before a model loads."""
    allowed = tuple(allowed)
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in allowed]
    if bad:
        raise RagfuseError(f"unknown eval mode(s) {', '.join(bad)} (known: {', '.join(allowed)})")
    return modes


def check_examples(engine: LLMEngine, builder: RagPromptBuilder, examples: list[Example], max_tokens: int) -> None:
    """Refuse, before the first case runs, examples the run would fail on part way: no gold answer
    (F1 undefined) or a prompt that with its answer does not fit the model's context. RagfuseError
    names them and says what to change."""
    limit = engine.max_model_len
    for i, ex in enumerate(examples):
        if not ex.answers:
            raise RagfuseError(f"example {i} has no gold answer")
        n = len(builder.token_ids([builder.passage_tokens(p) for p in ex.passages], ex.question))
        if n + max_tokens > limit:
            raise RagfuseError(
                f"example {i}: its prompt of {n} tokens and {max_tokens} answer tokens exceed the model's "
                f"context of {limit} tokens (use fewer passages, --max-passages, or drop the example)")


def evaluate(
    engine: LLMEngine,
    examples: list[Example],
    modes: Iterable[str],
    ratio: float,
    policy: SelectionPolicy,
    sweep: Iterable[float] = (),
    sweep_modes: Iterable[str] = ("fuse", "fuse-paper"),
    max_tokens: int = 16,
    progress: Any = None,
    kv_context: str = "instruction",
) -> dict[str, Any]:
    """Run every mode (and the ratio sweep) on every example; return per-mode summaries. Passages'
    KV is stored as a store with chunk KV context ``kv_context`` holds it (``chunk_kv.py``)."""
    modes = list(dict.fromkeys(modes))  # once each: a repeat would count every case twice in the row
    sweep = list(dict.fromkeys(sweep))
    sweep_modes = list(dict.fromkeys(sweep_modes)) if sweep else []
    known = (*FUSION_MODES, NOISE_MODE, *BASELINE_MODES)
    bad = [m for m in modes if m not in known]
    bad += [m for m in sweep_modes if m not in FUSION_MODES]
    if bad:
        raise RagfuseError(f"unknown eval mode(s) {bad} ({', '.join(known)}; sweeps: {', '.join(FUSION_MODES)})")
    if not modes and not sweep_modes:
        raise RagfuseError(f"no eval mode given ({', '.join(known)})")
    builder = RagPromptBuilder(engine.tokenizer)
    check_examples(engine, builder, examples, max_tokens)
    chains = baseline_chains(engine, max_tokens) if set(modes) & set(BASELINE_MODES) else None
    # (row key, eval mode, ratio): the main modes at ``ratio``, then the sweep's points
    jobs = [(m, m, ratio) for m in modes] + [(f"{m}@{r:g}", m, r) for m in sweep_modes for r in sweep]
    rows: dict[str, list[dict[str, Any]]] = {}
    full_answers: list[str] = []
    t0 = time.perf_counter()
    interrupted = False
    try:
        for ex in examples:
            case = build_case(engine, builder, ex.passages, ex.question, max_tokens, kv_context)
            full_answer = engine.tokenizer.decode(case.answer_ids, skip_special_tokens=True).strip()
            done: dict[tuple[str, float], dict[str, Any]] = {}
            for _key, name, r in jobs:
                if (name, r) not in done:
                    out = _run_job(engine, case, ex, name, r, policy, chains, max_tokens)
                    done[(name, r)] = {**out, "full_answer": full_answer, "gold": ex.answers}
            # a case's rows join only once all its jobs ran, so an interrupted run holds whole cases
            for key, name, r in jobs:
                rows.setdefault(key, []).append(done[(name, r)])
            full_answers.append(full_answer)
            if progress is not None:  # running F1 and TTFT per mode: a long run shows its figures as it goes
                running = {k: summarize(v, None) for k, v in rows.items() if "@" not in k}
                progress.set_postfix_str("; ".join(f"{k} f1 {m['f1']:.3f} ttft {m['ttft_s']:.2f}s"
                                                   for k, m in running.items()), refresh=False)
                progress.update(1)
    except KeyboardInterrupt:
        # Ctrl-C in a run of an hour or more: the cases finished so far are summed up and reported
        if not full_answers:
            raise
        interrupted = True
    reuse_kl = _reuse_kl(rows)
    return {
        "modes": {k: summarize(v, reuse_kl) for k, v in rows.items()},
        "cases": [{"question": ex.question, "gold": ex.answers, "full_answer": full_answers[i],
                   "modes": {k: {f: v[i][f] for f in CASE_FIELDS} for k, v in rows.items()}}
                  for i, ex in enumerate(examples[: len(full_answers)])],
        "elapsed_s": time.perf_counter() - t0,
        "interrupted": interrupted,
    }


def _run_job(
    engine: LLMEngine, case: Case, ex: Example, name: str, ratio: float, policy: SelectionPolicy,
    chains: Any, max_tokens: int,
) -> dict[str, Any]:
    """One eval mode (``name`` at ``ratio``) on one prepared case: its answer and measures."""
    if name in BASELINE_MODES:
        return run_baseline(chains, ex, name)
    if name == "full" and case.full_stats is not None:
        return full_row(engine, case)
    if name == NOISE_MODE:
        return run_mode(engine, rounded_full_case(engine, case), "reuse", policy, max_tokens)
    mode, pol = policy_for(name, ratio, policy)
    return run_mode(engine, case, mode, pol, max_tokens)


def _reuse_kl(rows: dict[str, list[dict[str, Any]]]) -> float | None:
    for key in ("reuse", "fuse@0", "fuse-paper@0"):
        if key in rows:
            return sum(r["kl_tf"] for r in rows[key]) / len(rows[key])
    return None
