"""Span planning and keys: pure Python, runs in both venvs."""

import pytest
import torch

from ragfuse.connectors.vllm.plan import CHUNK, CONTEXT, context_key, normalise_chunks, plan_spans
from ragfuse.engine.kvstore import kv_key

FP = "fp-test"


def test_spans_cover_prompt_and_cut_context_at_absolute_multiples() -> None:
    tokens = list(range(300))
    spans = plan_spans(tokens, [(140, 200)], FP, torch.float32, span_tokens=128)
    assert [(s.start, s.end, s.kind) for s in spans] == [
        (0, 128, CONTEXT), (128, 140, CONTEXT), (140, 200, CHUNK), (200, 256, CONTEXT), (256, 300, CONTEXT)]


def test_chunk_key_is_the_engines_key_and_position_free() -> None:
    chunk = list(range(1000, 1050))
    a = plan_spans([1, 2, 3, *chunk, 9], [(3, 53)], FP, torch.float32, 128)
    b = plan_spans([7] * 90 + chunk, [(90, 140)], FP, torch.float32, 128)
    key = kv_key(FP, torch.float32, chunk)
    assert [s.key for s in a if s.kind == CHUNK] == [key] == [s.key for s in b if s.kind == CHUNK]


def test_session_extension_keeps_history_keys_and_reuse_changes_context_keys() -> None:
    turn1 = list(range(400))
    turn2 = turn1 + list(range(5000, 5100))
    k1 = [s.key for s in plan_spans(turn1, [], FP, torch.float32, 128)]
    k2 = [s.key for s in plan_spans(turn2, [], FP, torch.float32, 128)]
    assert k1[:3] == k2[:3]  # the full 128-token spans of the history
    assert k1[3] != k2[3]  # the history's partial tail is a different span in the longer prompt
    assert context_key(FP, torch.float32, turn1) != context_key(FP, torch.float32, turn1, [(10, 20)])
    assert context_key(FP, torch.float32, turn1) != context_key(FP, torch.bfloat16, turn1)


def test_bad_chunk_spans_are_refused() -> None:
    with pytest.raises(ValueError):
        normalise_chunks([[5, 3]], 10)
    with pytest.raises(ValueError):
        normalise_chunks([[0, 5], [4, 8]], 10)
    assert normalise_chunks([[6, 8], [0, 5]], 10) == [(0, 5), (6, 8)]
