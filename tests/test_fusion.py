"""Cache fusion on the default model: exactness where it must be exact, and what it approximates."""

from __future__ import annotations

import json

import pytest
import torch

from ragfuse.engine import SamplingParams
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.kernels.paged_attention import attention_with_lse
from ragfuse.shared_data import shared_data

DATA = shared_data("musique_dev.json")


@pytest.fixture(scope="module")
def rag_prompt(engine):
    """An instruction prefix, three stored passages of a real MuSiQue case, and the question."""
    tok = engine.tokenizer
    ex = json.loads(DATA.read_text())[0]
    pre = tok.encode(
        "<|im_start|>system\nAnswer the question using the passages.<|im_end|>\n<|im_start|>user\n",
        add_special_tokens=False,
    )
    chunks = [tok.encode(f"{c['title']}\n{c['text']}\n\n", add_special_tokens=False) for c in ex["ctxs"][:3]]
    question = tok.encode(f"Question: {ex['question']}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    kvs = engine.compute_kv([pre, *chunks])
    segs = [Segment(pre, TensorKV(*kvs[0]))]
    segs += [Segment(c, TensorKV(*kv)) for c, kv in zip(chunks, kvs[1:], strict=True)]
    segs.append(Segment(question))
    return segs


def fused_logits(engine, segs, mode, policy=None):
    table: list[int] = []
    n = sum(len(s.token_ids) for s in segs)
    engine.blocks.grow(table, n)
    try:
        logits, stats = engine.runner.fused_prefill(table, segs, mode, policy or SelectionPolicy())
    finally:
        engine.blocks.release(table)
    return logits.log_softmax(-1), stats


def kl(p_log, q_log):
    return torch.nn.functional.kl_div(q_log, p_log, log_target=True, reduction="sum").item()


def test_full_and_fuse_at_ratio_one_equal_plain_prefill(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    full, st_full = fused_logits(engine, rag_prompt, "full")
    assert (full - ref).abs().max().item() == 0.0
    assert st_full.stored_tokens == 0
    every, st = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy(ratio=1.0))
    assert (every - ref).abs().max().item() < 1e-4
    assert st.recompute_ratio == 1.0 and st.reused_tokens == len(rag_prompt[0].token_ids)
    # recomputing every chunk, fusion loads only the exact prefix's stored KV, not the chunks' it would discard
    assert st.stored_tokens == len(rag_prompt[0].token_ids)


def test_prefix_mode_reuses_the_exact_prefix(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    got, st = fused_logits(engine, rag_prompt, "prefix")
    assert (got - ref).abs().max().item() < 1e-4
    assert st.reused_tokens == len(rag_prompt[0].token_ids) and st.recomputed_tokens == 0


def test_quality_improves_with_the_recompute_ratio(engine, rag_prompt):
    ids = [t for s in rag_prompt for t in s.token_ids]
    ref = engine.score(ids, last_n=1)[0].log_softmax(-1)
    reuse, st = fused_logits(engine, rag_prompt, "reuse")
    assert st.recomputed_tokens == 0 and st.computed_tokens == len(rag_prompt[-1].token_ids)
    kls = [kl(ref, reuse)]
    for r in (0.15, 0.5):
        got, st = fused_logits(engine, rag_prompt, "fuse", SelectionPolicy(ratio=r))
        assert abs(st.recompute_ratio - r) < 0.01
        assert st.active_per_layer[-1] == st.recomputed_tokens + st.computed_tokens
        kls.append(kl(ref, got))
    assert kls[0] > 0.01  # reuse without recompute really is approximate here
    assert kls[0] > kls[1] > kls[2]


def test_stored_keys_are_rotated_to_their_real_offset(engine, rag_prompt):
    """Layer 0's K depends only on the token and its position, so a stored chunk moved to offset p
    must hold exactly the keys that full prefill computes at p."""
    ids = [t for s in rag_prompt for t in s.token_ids]
    table: list[int] = []
    engine.blocks.grow(table, len(ids))
    try:
        engine.runner.fused_prefill(table, rag_prompt, "reuse", SelectionPolicy())
        fused_k, _ = engine.runner.kv_cache.gather(table, len(ids))
        fused_k0 = fused_k[0].clone()
    finally:
        engine.blocks.release(table)
    table = []
    engine.blocks.grow(table, len(ids))
    try:
        engine.runner.fused_prefill(table, rag_prompt, "full", SelectionPolicy())
        full_k, _ = engine.runner.kv_cache.gather(table, len(ids))
    finally:
        engine.blocks.release(table)
    assert (fused_k0 - full_k[0]).abs().max().item() < 1e-4


def test_scattered_query_positions_get_an_exact_causal_mask():
    torch.manual_seed(0)
    q = torch.randn(30, 4, 16)
    k, v = torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    full_out, full_lse = attention_with_lse(q, k, v, 0.25, 0)
    pick = torch.tensor([0, 3, 4, 17, 29])
    out, lse = attention_with_lse(q[pick], k, v, 0.25, 0, q_positions=pick)
    assert torch.allclose(out, full_out[pick], atol=1e-5) and torch.allclose(lse, full_lse[pick], atol=1e-5)


def test_many_scattered_queries_match_full_causal_attention():
    """Blocks of scattered queries (unmasked keys before each block, a small mask inside it) give
    exactly the rows of full causal attention, whether a block starts at position 0 or not."""
    torch.manual_seed(1)
    q = torch.randn(400, 9, 32)
    k, v = torch.randn(400, 3, 32), torch.randn(400, 3, 32)
    full_out, full_lse = attention_with_lse(q, k, v, 0.2, 0)
    pick = torch.cat([torch.tensor([0, 1]), torch.randperm(397)[:120].sort().values + 2, torch.arange(380, 400)])
    pick = pick.unique()
    out, lse = attention_with_lse(q[pick], k, v, 0.2, 0, q_positions=pick)
    assert torch.allclose(out, full_out[pick], atol=1e-5) and torch.allclose(lse, full_lse[pick], atol=1e-5)


def test_decoding_continues_from_the_fused_cache(llm, rag_prompt):
    eng = llm.engine
    ids = [t for s in rag_prompt for t in s.token_ids]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = llm.generate([ids], params)[0].token_ids
    rid, stats = eng.add_fused_request(rag_prompt, params, mode="fuse", policy=SelectionPolicy(ratio=1.0))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out = o
    assert out is not None and out.finished and out.token_ids == plain
    assert eng.blocks.num_free == eng.blocks.num_blocks
