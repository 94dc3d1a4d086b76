"""Measuring how far a fusion mode's output distribution is from full prefill's.

``kl_tf`` scores full prefill's own greedy answer under each mode, teacher-forced, so that one early
difference does not compound into a different continuation: it measures the prompt's KV, not luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragfuse.chunk_kv import ChunkKV
from ragfuse.engine import LLMEngine
from ragfuse.engine.fusion import FusionStats, Segment, SelectionPolicy, TensorKV
from ragfuse.prompt import RagPromptBuilder


def kl_rows(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per row, natural log; never below 0 (a KL is not: where two rows agree to
    rounding, the sum's rounding can dip below, and would read as better than exact). A token the
    reference rules out (logit -inf: a masked or padded vocabulary entry) adds nothing, as 0 log 0 = 0
    in the definition; computed as written it is 0 * (-inf - q) = NaN, which made the whole row NaN."""
    p = ref_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    terms = (p.exp() * (p - q)).masked_fill(p == float("-inf"), 0.0)
    return terms.sum(-1).clamp_min(0.0)


@dataclass
class Case:
    """One prompt, fusion-ready: its segments (stored pieces carry in-memory KV) and full's answer."""

    segments: list[Segment]
    answer_ids: list[int]  # full prefill's greedy answer
    full_logits: torch.Tensor  # full prefill's logits at the prompt end and along its answer
    full_stats: FusionStats | None = None  # the full prefill's own stats (TTFT), when this run made it


@torch.inference_mode()
def build_case(
    engine: LLMEngine, builder: RagPromptBuilder, passages: list[str], question: str, answer_tokens: int,
    kv_context: str = "instruction",
) -> Case:
    """Store the instruction prefix and each passage (as ingest does into a store whose chunk KV
    context is ``kv_context``), then answer greedily after one full prefill, keeping the logits of
    every step: they are full prefill's logits along its own answer, teacher-forced by
    construction (one prefill, not a second pass to score it)."""
    segs = stored_segments(engine, builder, passages, question, kv_context)
    n = sum(len(s.token_ids) for s in segs)
    runner = engine.runner
    with engine.borrowed_blocks([[0] * (n + answer_tokens)]) as (table,):
        first, stats = runner.fused_prefill(table, segs, "full", SelectionPolicy())
        rows, answer = [first], [int(first.argmax())]
        while len(answer) < answer_tokens and answer[-1] not in engine.eos_token_ids:
            h = runner.forward_continuation(answer[-1:], n + len(answer) - 1, table)
            rows.append(runner.model.compute_logits(h)[0])
            answer.append(int(rows[-1].argmax()))
    keep = [i for i, t in enumerate(answer) if t not in engine.eos_token_ids] or [0]
    # full_logits[i] predicts answer[i]; an end-of-sequence token is never scored
    return Case(segs, [answer[i] for i in keep], torch.stack(rows)[: len(keep)].float(), stats)


def stored_segments(
    engine: LLMEngine, builder: RagPromptBuilder, passages: list[str], question: str, kv_context: str = "instruction"
) -> list[Segment]:
    """The prompt's segments: the instruction prefix with its KV (a sequence start) and each passage
    with its KV as a store with this chunk KV context holds it (``chunk_kv.py``)."""
    pieces = [builder.passage_tokens(p) for p in passages]
    (prefix_kv,) = engine.compute_kv([builder.prefix])
    kvs = ChunkKV.for_context(engine, kv_context, builder).compute(pieces)
    segs = [Segment(builder.prefix, TensorKV(*prefix_kv), "instruction")]
    for i, (toks, kv) in enumerate(zip(pieces, kvs, strict=True)):
        if i:
            segs.append(Segment(builder.separator, None, "separator"))
        segs.append(Segment(toks, TensorKV(*kv), f"passage {i}"))
    segs.append(Segment(builder.tail(question), None, "question"))
    return segs


def mode_kl(engine: LLMEngine, case: Case, mode: str, policy: SelectionPolicy) -> tuple[float, float, dict]:
    """(first-token KL, mean teacher-forced KL over full's answer, fusion stats) of ``mode``."""
    logits, stats = engine.score_fused(case.segments, case.answer_ids[:-1], mode, policy)
    kls = kl_rows(case.full_logits, logits)
    return float(kls[0]), float(kls.mean()), stats.__dict__
