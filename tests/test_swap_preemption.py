"""Preempted fused and session requests keep their KV in host memory (engine/swap.py): under cache
pressure they resume on exactly the KV they had, so the load on the engine never changes their answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ragfuse.engine.fusion import Segment, TensorKV
from ragfuse.engine.sessions import SessionStore
from tests.test_engine_scheduling import RANDOM_SHAPE, prompts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def engine(kv_blocks: int, device: str = "cpu", **kw) -> LLMEngine:
    mc = ModelConfig.from_dict(RANDOM_SHAPE)
    per_block = mc.kv_bytes_per_token(torch.float32) * 4
    cfg = EngineConfig(device=device, dtype="float32", block_size=4, kv_cache_bytes=kv_blocks * per_block, **kw)
    return LLMEngine(cfg, random_weights=mc)


def fused_segments(eng: LLMEngine) -> list[Segment]:
    """Two stored passages reused as they are (``reuse``: no recompute) and a question: KV that a
    prefill of the same tokens would not give."""
    a, b, question = prompts(3, 12)
    kvs = eng.compute_kv([a, b])
    return [Segment(a, TensorKV(*kvs[0])), Segment(b, TensorKV(*kvs[1])), Segment(question)]


def start_fused_behind_others(eng: LLMEngine) -> tuple[str, list[str]]:
    """Five plain requests decoding, then a fused one: the newest, so the first preempted when the
    cache runs out."""
    others = [eng.add_request(p, PARAMS) for p in prompts(5, 10)]
    for _ in range(2):
        eng.step()
    rid, _ = eng.add_fused_request(fused_segments(eng), PARAMS, mode="reuse")
    return rid, others


def finish(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step() if o.finished}
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_preempted_fused_request_resumes_on_its_own_kv(device):
    """A fused request preempted for want of blocks answers what it answers with room to spare; a
    recompute by prefill would have replaced its reused KV by exact KV and changed the answer."""
    roomy_eng = engine(400, device)
    roomy_rid, roomy_others = start_fused_behind_others(roomy_eng)
    roomy = finish(roomy_eng)
    tight_eng = engine(36, device)
    rid, others = start_fused_behind_others(tight_eng)
    tight = finish(tight_eng)
    assert roomy[roomy_rid].metrics["preemptions"] == 0
    assert tight[rid].metrics["preemptions"] >= 1 and tight[rid].metrics["swapped"] >= 1
    assert tight[rid].token_ids == roomy[roomy_rid].token_ids
    assert [tight[r].token_ids for r in others] == [roomy[r].token_ids for r in roomy_others]
    assert tight_eng.blocks.num_free == tight_eng.blocks.num_blocks
    assert tight_eng.scheduler.swap.used_bytes == 0


@pytest.mark.parametrize("budget", [0, 1024])
def test_without_swap_space_a_preempted_fused_request_is_recomputed(budget, caplog):
    """``swap_space_bytes=0`` (or a budget the request does not fit) keeps the old way: the request
    is recomputed by prefill and still completes, and every block comes back; a budget too small
    says so, since the answer may then depend on the load."""
    eng = engine(36, swap_space_bytes=budget)
    rid, _ = start_fused_behind_others(eng)
    with caplog.at_level("WARNING", logger="ragfuse.engine"):
        out = finish(eng)[rid]
    assert out.metrics["preemptions"] >= 1 and out.metrics["swapped"] == 0
    assert len(out.token_ids) == PARAMS.max_tokens
    assert eng.blocks.num_free == eng.blocks.num_blocks
    warned = [r.getMessage() for r in caplog.records if "swap space" in r.getMessage()]
    assert (budget > 0) == bool(warned)
    assert not warned or f"request {rid} preempted" in warned[0]


def step_until_swapped(eng: LLMEngine, rid: str) -> None:
    seq = eng._seqs[rid]
    for _ in range(50):
        eng.step()
        if eng.scheduler.swapped(seq):
            return
    raise AssertionError("the fused request was never swapped out")


def test_aborting_a_swapped_request_frees_its_host_copy():
    eng = engine(36)
    rid, others = start_fused_behind_others(eng)
    step_until_swapped(eng, rid)
    assert eng.scheduler.swap.used_bytes > 0
    eng.abort(rid)
    assert eng.scheduler.swap.used_bytes == 0
    outs = finish(eng)
    assert rid not in outs and set(others) <= set(outs)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_fused_start_waits_behind_preempted_requests():
    """A fused prefill takes its blocks as it starts: while a preempted request waits for blocks it
    is refused as if the cache were full (``when_room`` and the async engine retry it), else each new
    start took the room the preempted one waited for, and was preempted in turn."""
    from ragfuse.engine.errors import CacheFullError

    eng = engine(36)
    rid, others = start_fused_behind_others(eng)
    step_until_swapped(eng, rid)
    seq = eng._seqs[rid]
    with pytest.raises(CacheFullError, match="preempted for want of KV cache blocks resume first"):
        eng.add_fused_request(fused_segments(eng), PARAMS, mode="reuse")
    late = eng.when_room(lambda: eng.add_fused_request(fused_segments(eng), PARAMS, mode="reuse")[0])
    assert not eng.scheduler.swapped(seq) and seq.num_swaps >= 1  # resumed before the late start
    outs = finish(eng)
    assert {rid, late, *others} <= set(outs) and outs[late].token_ids == outs[rid].token_ids
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_start_refused_behind_a_preempted_request_starts_once_it_resumes():
    """A start refused because a preempted request waited is tried again as soon as that request
    resumes (``LLMEngine.room_since``): retried only once more blocks were free than at its refusal,
    it waited here until the resumed request had finished, since resuming takes blocks."""
    eng = engine(36)
    rid, _ = start_fused_behind_others(eng)
    step_until_swapped(eng, rid)
    seq = eng._seqs[rid]
    late = eng.when_room(lambda: eng.add_fused_request(
        [Segment([7, 8, 9])], SamplingParams(max_tokens=2, ignore_eos=True), mode="full")[0])
    assert seq.num_swaps >= 1 and not eng.scheduler.swapped(seq) and not seq.finished
    outs = finish(eng)
    assert {rid, late} <= set(outs) and eng.blocks.num_free == eng.blocks.num_blocks


def session_turn_behind_others(eng: LLMEngine, store: Path, max_tokens: int) -> tuple[list[int], str, list[str]]:
    """A session's first turn alone, then five plain requests decoding and the session's second
    turn (reusing the stored first): the newest, so the first preempted when the cache runs out."""
    eng.enable_sessions(SessionStore(store, eng.fingerprint, torch.float32))
    first = prompts(1, 20)[0]
    eng.add_session_request("s", first, SamplingParams(max_tokens=8, ignore_eos=True))
    answer = finish(eng)
    conversation = first + next(iter(answer.values())).token_ids + prompts(1, 6)[0]
    others = [eng.add_request(p, PARAMS) for p in prompts(5, 10)]
    for _ in range(2):
        eng.step()
    rid = eng.add_session_request("s", conversation, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return conversation, rid, others


def test_a_session_turn_preempted_on_stored_history_is_swapped_and_saved_whole(tmp_path):
    """A turn reusing its session's stored history is not recomputed when preempted; its session is
    saved with the whole turn, so the next turn reuses every earlier token."""
    eng = engine(36)
    conversation, rid, others = session_turn_behind_others(eng, tmp_path, 12)
    out = finish(eng)
    assert out[rid].metrics["swapped"] >= 1 and set(others) <= set(out)
    nxt = eng.begin_session_turn("s", conversation + out[rid].token_ids + [5, 6], reserve=4, new_tokens=2)
    assert nxt.reused == len(conversation) + len(out[rid].token_ids)
    nxt.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "4GiB"])
def test_swap_space_must_be_a_byte_count(bad):
    from ragfuse.engine.errors import ModelError

    with pytest.raises(ModelError, match="swap_space_bytes must be a non-negative integer"):
        EngineConfig(swap_space_bytes=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_a_session_turn_swapped_out_before_its_closing_step_is_saved_from_its_host_copy(device, tmp_path):
    """A finished turn waits for one more decode step to compute its last token's KV; preempted
    before that step, its KV is only in host memory. Its session is saved from there (all but the
    last token), so the next turn reuses the finished turn instead of only the one before it."""
    eng = engine(36, device)
    conversation, rid, others = session_turn_behind_others(eng, tmp_path, 3)
    done = None
    while done is None:
        done = next((o for o in eng.step() if o.request_id == rid and o.finished), None)
    eng.step()  # the five others grow: the finished turn, the newest, is preempted before closing
    nxt = eng.begin_session_turn("s", conversation + done.token_ids + [5, 6], reserve=4, new_tokens=2)
    assert nxt.reused == len(conversation) + len(done.token_ids) - 1
    nxt.close()
    assert set(others) <= set(finish(eng))
    assert eng.blocks.num_free == eng.blocks.num_blocks and eng.scheduler.swap.used_bytes == 0


@pytest.mark.gpu
def test_a_copy_back_runs_on_a_side_stream_and_lands_before_its_pages_are_read():
    """On CUDA the copy back is queued beside the compute stream: the request counts as arrived
    only once it has landed, and work that reads its pages first waits for it."""
    eng = engine(96, "cuda")
    swap, storage = eng.scheduler.swap, eng.runner.kv_cache.storage
    table: list[int] = []
    other: list[int] = []
    eng.blocks.grow(table, 160)
    eng.blocks.grow(other, 160)
    src, dst = (torch.tensor(t, device=storage.device) for t in (table, other))
    storage[:, :, src] = torch.randn_like(storage[:, :, src])
    original = storage[:, :, src].clone()
    assert swap.swap_out("r", table)
    swap.swap_in("r", other)
    assert swap.await_arrivals() and swap.arrived("r")
    assert torch.equal(storage[:, :, dst], original)
    assert swap.used_bytes == 0 and not swap.holds("r")
