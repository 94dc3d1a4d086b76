"""The prefix tree of KV blocks: matching, sharing, reference counts, LRU eviction, no leaks, and
the engine with the tree against the engine without it (identical greedy outputs, less prefill)."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ragfuse.engine.block_manager import BlockManager
from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV
from ragfuse.engine.prefix_tree import PrefixTree
from ragfuse.engine.sequence import Sequence

from .test_engine_scheduling import random_engine


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def computed(tree: PrefixTree, s: Sequence) -> None:
    """What the scheduler does for a prompt: take cached blocks, then grow and insert the rest."""
    tree.match(s)
    tree.blocks.grow(s.block_table, s.num_tokens)
    tree.insert(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens


def test_match_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=4)
    tree = PrefixTree(bm)
    a = seq(list(range(10)))  # two full blocks + 2 tokens
    computed(tree, a)
    assert a.tree_depth == 2 and len(tree) == 2 and a.num_cached_tokens == 0
    b = seq(list(range(8)) + [99, 98, 97])
    computed(tree, b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [3, 3]  # a, b and the tree
    # a prompt that is exactly two blocks keeps its last token to compute: only one block matches
    c = seq(list(range(8)))
    assert tree.match(c) == 4 and c.num_computed_tokens == 4
    tree.unmatch(c)
    assert c.block_table == [] and bm.ref_counts[a.block_table[0]] == 3
    # a different first block matches nothing (a forest: a second root)
    d = seq([7, 7, 7, 7, 1])
    computed(tree, d)
    assert d.num_cached_tokens == 0 and len(tree) == 3


def test_identical_prompts_computed_together_keep_the_second_private():
    bm = BlockManager(num_blocks=8, block_size=2)
    tree = PrefixTree(bm)
    a, b = seq([1, 2, 3, 4, 5]), seq([1, 2, 3, 4, 5])
    for s in (a, b):  # both scheduled before either inserted: the second finds the nodes taken
        bm.grow(s.block_table, 5)
    tree.insert(a, 5)
    tree.insert(b, 5)
    assert a.tree_depth == 2 and b.tree_depth == 0 and not b.tree_open and len(tree) == 2


def test_eviction_takes_least_recently_used_leaves_and_nothing_leaks():
    bm = BlockManager(num_blocks=6, block_size=2)
    tree = PrefixTree(bm)
    old = seq([1, 2, 3, 4, 9])  # blocks [1,2] -> [3,4]
    computed(tree, old)
    new = seq([5, 6, 7])  # block [5,6]
    computed(tree, new)
    for s in (old, new):
        bm.release(s.block_table)
        tree.forget(s)
    assert bm.num_reclaimable == 3 and bm.num_free == 6 and len(bm.free_ids) == 3
    # five blocks: the three free ones first, then evictions, oldest leaf first ([3,4], then [1,2])
    table: list[int] = []
    bm.grow(table, 8)
    assert len(tree) == 2 and tree.num_evicted == 1
    assert tree.root.children[(5, 6)] and (1, 2) in tree.root.children
    bm.grow(table, 10)
    assert list(tree.root.children) == [(5, 6)]
    # a block in use is never evicted: the pool is then really full
    again = seq([5, 6, 8])
    tree.match(again)
    assert again.num_cached_tokens == 2 and bm.num_free == 0
    bm.release(table)
    bm.release(again.block_table)
    tree.clear()
    assert len(tree) == 0 and len(bm.free_ids) == 6 and bm.num_reclaimable == 0
    assert all(r == 0 for r in bm.ref_counts)


def test_engine_reuses_prefix_blocks_and_frees_them_all(engine_pair):
    """Random-weight engine under memory pressure: sharing, eviction and preemption together."""
    with_tree, without = engine_pair
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 128, (37,), generator=g).tolist()
    ps = [prefix + torch.randint(1, 128, (3 + i,), generator=g).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    got = LLM.from_engine(with_tree).generate(ps, params)
    want = LLM.from_engine(without).generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics["cached_tokens"] for o in got) >= 5 * 36
    assert with_tree.blocks.num_free == with_tree.blocks.num_blocks
    with_tree.tree.clear()
    assert len(with_tree.blocks.free_ids) == with_tree.blocks.num_blocks


@pytest.fixture
def engine_pair():
    return random_engine(kv_blocks=40), random_engine(kv_blocks=400, prefix_tree=False)


def test_engine_under_pressure_evicts_and_matches_untreed_outputs():
    ps = [list(range(1, 30)) + [40 + i] * (5 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tight = random_engine(kv_blocks=30)
    got = LLM.from_engine(tight).generate(ps, params)
    want = LLM.from_engine(random_engine(kv_blocks=400, prefix_tree=False)).generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert tight.tree.num_evicted > 0
    assert tight.blocks.num_free == tight.blocks.num_blocks


@pytest.fixture(scope="module")
def plain_engine():
    """The default model without the prefix tree, for side-by-side runs with the session engine."""
    return LLMEngine(EngineConfig(device="cpu", prefix_tree=False))


@pytest.fixture(scope="module")
def shared_prompts(engine):
    """Four chat prompts behind one long few-shot instruction (about 600 tokens in common)."""
    shots = "\n".join(f"Example {i}: the capital of country number {i} is city number {i * 7 % 13}." for i in range(40))
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2+2?", "Who wrote Hamlet?"]
    llm = LLM.from_engine(engine)
    return [llm.chat_ids([{"role": "user", "content": q}], system=f"Answer briefly.\n{shots}") for q in questions]


def test_default_model_greedy_is_identical_with_less_prefill(llm, engine, plain_engine, shared_prompts):
    common = 0
    while all(p[common] == shared_prompts[0][common] for p in shared_prompts):
        common += 1
    assert common > 500
    params = SamplingParams(max_tokens=16)
    engine.tree.clear()
    got = llm.generate(shared_prompts, params)
    want = LLM.from_engine(plain_engine).generate(shared_prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    cached = [o.metrics["cached_tokens"] for o in got]
    assert cached[0] == 0 and all(c >= common - engine.config.block_size for c in cached[1:])
    assert all(o.metrics["cached_tokens"] == 0 for o in want)
    # the prompts were scheduled in one step: the later ones read blocks the first one was writing
    prefill_with = sum(len(p) for p in shared_prompts) - sum(cached)
    assert prefill_with < 0.45 * sum(len(p) for p in shared_prompts)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_fused_prompt_after_a_shared_prefix(llm, engine, shared_prompts):
    """A fused RAG prompt is a private suffix after a prefix the tree holds: running beside plain
    requests that share that prefix, it decodes as a plain request of the same prompt would, and
    its (approximate) blocks never join the tree."""
    prefix = shared_prompts[0][:-8]
    passage = engine.tokenize("Paris is the capital and largest city of France.\n")
    question = shared_prompts[0][-8:]
    kvs = engine.compute_kv([prefix, passage])
    segs = [Segment(prefix, TensorKV(*kvs[0])), Segment(passage, TensorKV(*kvs[1])), Segment(question)]
    ids = prefix + passage + question
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = llm.generate([ids], params)[0].token_ids  # leaves the prompt's blocks in the tree
    others = [engine.add_request(p, params) for p in shared_prompts[1:]]
    rid, _ = engine.add_fused_request(segs, params, mode="fuse", policy=SelectionPolicy(ratio=1.0))
    fused_blocks = set(engine.scheduler.running[-1].block_table)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        assert not fused_blocks & set(engine.tree.nodes) or rid in outs
    assert outs[rid].token_ids == plain
    assert all(outs[r].metrics["cached_tokens"] > 500 for r in others)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_tree_behind_relay_system_prompts_is_kept_per_system():
    """Requests behind a registered system prompt share their common prefix through the tree (two-phase
    decode with the relay system part merged in), equal to the engine without the tree; a prefix behind
    one system prompt is never served behind another, and releasing a system prompt frees its tree."""
    g = torch.Generator().manual_seed(5)
    systems = [torch.randint(1, 128, (14 + i,), generator=g).tolist() for i in range(2)]
    prefix = torch.randint(1, 128, (21,), generator=g).tolist()
    ps = [prefix + torch.randint(1, 128, (2 + i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    treed, plain = random_engine(kv_blocks=200), random_engine(kv_blocks=200, prefix_tree=False)

    def run(eng: LLMEngine) -> tuple[list[int], list[list[list[int]]], list[int]]:
        ids = [eng.register_system(s) for s in systems]
        outs = [LLM.from_engine(eng).generate(ps, params, system=sid) for sid in ids]
        return ids, [[o.token_ids for o in out] for out in outs], [sum(o.metrics["cached_tokens"] for o in out)
                                                                  for out in outs]

    ids, got, cached_tokens = run(treed)
    _, want, plain_cached = run(plain)
    assert got == want
    assert got[0] != got[1]  # the system prompt matters: no cross-system sharing
    assert all(c >= 3 * 20 for c in cached_tokens) and plain_cached == [0, 0]
    cached = len(treed.tree)
    treed.release_system(ids[0])
    assert 0 < len(treed.tree) < cached
    treed.release_system(ids[1])
    assert len(treed.tree) == 0 and treed.blocks.num_free == treed.blocks.num_blocks
