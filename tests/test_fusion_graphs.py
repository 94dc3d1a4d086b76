"""CUDA graphs of the fused prefill's steady layers and whole check layers: which passes get them,
and (on CUDA) that a replayed pass gives the eager pass's logits and selections, for prompts of
different lengths sharing one capture."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import LLMEngine
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.engine.fusion.graphs import (
    CHECK_MAX_ROWS,
    PROMPT_STEP,
    STORED_STEP,
    CheckShape,
    FusionGraphs,
    capacity,
    check_rows,
)


def test_capacity_pads_active_to_buckets_and_stored_to_steps():
    assert capacity(32, 3072) == (64, 3072)
    assert capacity(416, 3073) == (416, 3072 + STORED_STEP)
    assert capacity(417, 1) == (448, STORED_STEP)
    assert capacity(646, 3072) == (704, 3072) and capacity(1024, 3072) == (1024, 3072)  # every 64 past 512
    assert capacity(1312, 3072) == (1344, 3072) and capacity(2592, 3072) == (2624, 3072)
    assert capacity(CHECK_MAX_ROWS, 3072) == (CHECK_MAX_ROWS, 3072)


def test_check_layers_pad_rows_to_32_up_to_their_cap_and_prompts_to_steps():
    assert check_rows(800) == 800 and check_rows(801) == 832 and check_rows(2592) == 2592
    assert check_rows(CHECK_MAX_ROWS) == CHECK_MAX_ROWS and check_rows(CHECK_MAX_ROWS + 1) is None
    shipped = SelectionPolicy.default()
    shape = CheckShape.of(2, 1184, 990, 3104, 33, shipped)
    assert shape is not None and (shape.rows_in, shape.rows_out, shape.prompt, shape.tail) == (1184, 992, 3584, 64)
    assert PROMPT_STEP == 512
    assert CheckShape.of(1, CHECK_MAX_ROWS + 1, 990, 3104, 33, shipped) is None
    unweighted = CheckShape.of(2, 1184, 990, 3104, 33, SelectionPolicy.paper(0.15))
    assert unweighted is not None and (unweighted.prompt, unweighted.tail) == (0, 0)  # no question attention


def test_larger_active_sets_than_check_layers_and_passes_without_stored_kv_run_eagerly():
    assert capacity(CHECK_MAX_ROWS + 1, 3072) is None
    assert capacity(32, 0) is None


SHIFTED = {"revert_dropped": True, "stale_shift": 0.5, "attention_weight": 0.1}  # as the shipped selection
SHORT = ((130, 77, 200), (120, 70, 190), (130, 77, 200))  # one capacity, stale padding in between
LONG = ((1000, 800, 700), (990, 800, 700))  # 2504 tokens at the first check layer


@pytest.mark.gpu
@pytest.mark.parametrize("mode,ratio,checks,extra,prompts", [
    ("reuse", 0.0, (1,), {}, SHORT), ("fuse", 0.15, (1,), {}, SHORT), ("fuse", 0.15, (1, 2), {}, SHORT),
    ("fuse", 0.15, (1, 2), SHIFTED, SHORT), ("fuse", 0.15, (1, 2), SHIFTED, LONG),
    ("fuse", 0.15, (1, 2), {**SHIFTED, "stale_shift_k": 0.1}, SHORT),
    ("fuse", 0.15, (1, 2), {**SHIFTED, "k_mass_cap": 0.05}, SHORT),
    ("fuse", 0.15, (1, 2), {**SHIFTED, "k_mass_cap": 0.05}, LONG),
    ("fuse", 0.15, (1, 2), {**SHIFTED, "k_mass_cap": 0.05, "tail_tokens": 24}, SHORT)])
def test_replayed_fusion_equals_the_eager_pass(mode, ratio, checks, extra, prompts):
    """Steady layers and, in ``fuse``, whole check layers replayed (gradual filtering over two check
    layers: one check graph's kept rows feed the next in place), also with the stale shift (K's share
    its own or V's, or capped by the question's mass move) and the question's attention weight, also with
    the tail of the passage nearest the question forced in, selecting the same tokens as the eager pass."""
    eng, graphs = _engine_with_graphs()
    g = torch.Generator().manual_seed(1)
    policy = SelectionPolicy(ratio=ratio, check_layers=checks, first_factor=2.0 if len(checks) > 1 else 1.0, **extra)
    for lengths in prompts:
        _replayed_equals_eager(eng, graphs, _prompt(eng, g, lengths), mode, policy)
    assert len(graphs.capacities) == 1
    assert bool(graphs.checks) == (mode == "fuse")


@pytest.mark.gpu
def test_a_first_capture_after_a_larger_pass_stays_inside_its_rows():
    """The graphs' static inputs keep the last pass's values until the next pass sends its own, which
    it does after capturing what it lacks. The question's rows left by a pass with more active rows
    pointed past a smaller capacity's, and that capacity's first capture indexed them: a device-side
    assert (which ends the process's CUDA context). With the K shift's cap on, a pass at 60% then a
    first one at 10% each equal their eager passes."""
    eng, graphs = _engine_with_graphs()
    segs = _prompt(eng, torch.Generator().manual_seed(3), (300, 280, 310))
    for ratio in (0.6, 0.1):
        policy = SelectionPolicy(ratio=ratio, check_layers=(1, 2), first_factor=2.0, **SHIFTED, k_mass_cap=0.05)
        _replayed_equals_eager(eng, graphs, segs, "fuse", policy)
    assert len(graphs.capacities) == 2


@pytest.mark.gpu
def test_least_recently_used_check_graphs_are_dropped_past_the_cap():
    """A server fusing prompts of many sizes keeps at most ``max_checks`` check-layer graphs; a pass
    whose graphs were dropped captures them again and still equals the eager pass."""
    eng, graphs = _engine_with_graphs()
    graphs.max_checks = 3  # one pass's worth: layer 0 and two check layers
    g = torch.Generator().manual_seed(2)
    policy = SelectionPolicy(ratio=0.15, check_layers=(1, 2), first_factor=2.0, **SHIFTED)
    for lengths in ((130, 77, 200), (260, 150, 300), (130, 77, 200)):  # the third needs the first's again
        _replayed_equals_eager(eng, graphs, _prompt(eng, g, lengths), "fuse", policy)
        assert len(graphs.checks) <= 3


def _engine_with_graphs() -> tuple[LLMEngine, FusionGraphs]:
    """A small float32 engine on CUDA (skipped without) and its fusion graphs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from .test_fusion_gpu import engine

    eng = engine("triton")
    graphs = eng.runner.fusion_graphs
    assert graphs is not None
    return eng, graphs


def _prompt(eng: LLMEngine, g: torch.Generator, lengths: tuple[int, ...]) -> list[Segment]:
    """Random chunks of these lengths with their KV computed alone, then a 5-token question."""
    chunks = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in lengths]
    segs = [Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, eng.compute_kv(chunks), strict=True)]
    return [*segs, Segment([5, 6, 7, 8, 9])]


def _replayed_equals_eager(eng: LLMEngine, graphs: FusionGraphs, segs: list[Segment], mode: str,
                           policy: SelectionPolicy) -> None:
    """The pass run eagerly, then replayed from ``graphs`` (capturing what they lack): the graphs
    served layers, and the two kept the same tokens and gave the same logits within rounding."""
    eng.runner.fusion_graphs = None
    eager, st_e = eng.score_fused(segs, [11, 12], mode, policy)
    eng.runner.fusion_graphs = graphs
    before = graphs.replays
    replayed, st_g = eng.score_fused(segs, [11, 12], mode, policy)
    assert graphs.replays > before
    assert st_g.active_per_layer == st_e.active_per_layer
    if st_e.recomputed_positions is not None and st_g.recomputed_positions is not None:
        assert st_g.recomputed_positions.tolist() == st_e.recomputed_positions.tolist()
    assert (replayed - eager).abs().max().item() < 1e-3 * eager.abs().max().item()
