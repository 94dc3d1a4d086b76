"""Measuring how far a fusion mode's output distribution is from full prefill's.

``kl_tf`` scores full prefill's own greedy answer under each mode, teacher-forced, so that one early
difference does not compound into a different continuation: it measures the prompt's KV, not luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragfuse.engine import LLMEngine, SamplingParams
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.prompt import RagPromptBuilder


def kl_rows(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, natural log."""
    p = ref_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@dataclass
class Case:
    """One prompt, fusion-ready: its segments (stored pieces carry in-memory KV) and full's answer."""

    segments: list[Segment]
    answer_ids: list[int]  # full prefill's greedy answer
    full_logits: torch.Tensor  # full prefill's logits at the prompt end and along its answer


def build_case(
    engine: LLMEngine, builder: RagPromptBuilder, passages: list[str], question: str, answer_tokens: int
) -> Case:
    """Store the instruction prefix and each passage alone (as ingest does), then run full prefill."""
    pieces = [builder.prefix] + [builder.passage_tokens(p) for p in passages]
    kvs = engine.compute_kv(pieces)
    segs = [Segment(builder.prefix, TensorKV(*kvs[0]), "instruction")]
    for i, (toks, kv) in enumerate(zip(pieces[1:], kvs[1:], strict=True)):
        if i:
            segs.append(Segment(builder.separator, None, "separator"))
        segs.append(Segment(toks, TensorKV(*kv), f"passage {i}"))
    segs.append(Segment(builder.tail(question), None, "question"))
    prompt = [t for s in segs for t in s.token_ids]
    from ragfuse.engine import LLM

    answer = LLM.from_engine(engine).generate([prompt], SamplingParams(max_tokens=answer_tokens))[0].token_ids
    answer = [t for t in answer if t not in engine.eos_token_ids] or answer[:1]
    full = engine.score(prompt + answer, last_n=len(answer) + 1)[:-1]
    return Case(segs, answer, full)


def mode_kl(engine: LLMEngine, case: Case, mode: str, policy: SelectionPolicy) -> tuple[float, float, dict]:
    """(first-token KL, mean teacher-forced KL over full's answer, fusion stats) of ``mode``."""
    logits, stats = engine.score_fused(case.segments, case.answer_ids[:-1], mode, policy)
    kls = kl_rows(case.full_logits, logits)
    return float(kls[0]), float(kls.mean()), stats.__dict__
