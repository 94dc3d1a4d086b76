"""The engine on CUDA with the Triton backend and decode graphs, against the torch backend.

A small random-weight model in float32 (the Triton kernels then use exact float32 dots), so both
backends should produce the same greedy tokens. The random output head is scaled up so the top
logits are well separated and a tie cannot decide a token.
"""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ragfuse.engine.attention import AttentionMetadata
from ragfuse.engine.cuda_graphs import captured_span, padded_size

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 0,
}


def cuda_engine(backend: str, monkeypatch: pytest.MonkeyPatch) -> LLMEngine:
    monkeypatch.setenv("RAGFUSE_KERNELS", backend)
    cfg = EngineConfig(device="cuda", dtype="float32", block_size=16, kv_cache_bytes=64 << 20)
    engine = LLMEngine(cfg, random_weights=ModelConfig.from_dict(SHAPE))
    with torch.no_grad():
        engine.runner.model.lm_head.weight.mul_(30.0)
    return engine


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # odd lengths, one on a block boundary, one crossing several blocks; 3 sequences pad to 4
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 32, 77)]


def generate(engine: LLMEngine, ps: list[list[int]], n: int) -> list[list[int]]:
    for p in ps:
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[k] for k in sorted(done, key=lambda r: int(r.split("-")[1]))]


def test_turns_after_short_and_long_histories_get_graphs_of_their_own() -> None:
    """Below the length at which attention splits its keys a graph is captured for fewer keys (one
    split, no programs that only exit); from it on, for the model's whole context (key splits)."""
    assert captured_span(4096, 32768, 16384) == 16383
    assert captured_span(16383, 32768, 16384) == 16383
    assert captured_span(16384, 32768, 16384) == 32768
    assert captured_span(28672, 32768, 16384) == 32768
    assert captured_span(1000, 4096, 16384) == 4096  # a context below the split length: one graph


@pytest.mark.gpu
def test_triton_with_graphs_generates_like_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = cuda_engine("torch", monkeypatch)
    assert ref.runner.attention_backend_name == "torch" and ref.runner.graphs is None
    want = generate(ref, prompts(), 40)
    ref_logits = ref.score(prompts()[2])
    del ref

    fast = cuda_engine("auto", monkeypatch)
    assert fast.runner.attention_backend_name == "triton"
    graphs = fast.runner.graphs
    assert graphs is not None and {1, 2, 4, 64} <= set(graphs.graphs)
    got = generate(fast, prompts(), 40)
    assert got == want
    assert graphs.replays >= 39  # every decode step of the batch went through a graph
    logits = fast.score(prompts()[2])  # prefill through the Triton kernel
    assert (logits - ref_logits).abs().max().item() < 1e-3 * ref_logits.abs().max().item()


def overlap_run(engine: LLMEngine, stop_at: dict[int, int]) -> dict[str, tuple[list[int], str | None, int]]:
    """Seven requests through a 3-sequence engine (a queue waits), mixed lengths, one stopped by a
    stop token, one aborted after its 5th token: each request's tokens, finish reason and streamed
    deltas."""
    g = torch.Generator().manual_seed(3)
    for i, (n, out) in enumerate(zip((5, 32, 77, 9, 16, 40, 3), (1, 7, 20, 33, 12, 26, 17))):
        stop = [stop_at[i]] if i in stop_at else []
        engine.add_request(torch.randint(1, 512, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=out, ignore_eos=True, stop_token_ids=stop), request_id=f"r{i}")
    got: dict[str, tuple[list[int], str | None, int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            toks, _, deltas = got.get(out.request_id, ([], None, 0))
            got[out.request_id] = (out.token_ids, out.finish_reason, deltas + len(out.delta_token_ids))
            if out.request_id == "r3" and len(out.token_ids) == 5:
                engine.abort("r3")  # while a step that holds its next token may be in flight
    return got


@pytest.mark.gpu
def test_overlapped_decode_reports_what_stepwise_decode_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decode steps launched before the previous step's tokens are read (the default) give the
    same tokens, stops, aborts and streamed deltas as steps that wait, and free every block. (When a
    stop token frees a place, a waiting request starts a step later: the test compares per request.)"""
    monkeypatch.setenv("RAGFUSE_KERNELS", "auto")

    def engine(overlap: bool) -> LLMEngine:
        cfg = EngineConfig(device="cuda", dtype="float32", block_size=16, kv_cache_bytes=64 << 20, max_num_seqs=3,
                           overlap_decode=overlap)
        eng = LLMEngine(cfg, random_weights=ModelConfig.from_dict(SHAPE))
        with torch.no_grad():
            eng.runner.model.lm_head.weight.mul_(30.0)
        return eng

    waiting = engine(False)
    free = waiting.blocks.num_free
    first = overlap_run(waiting, {})
    stop_at = {5: first["r5"][0][10]}  # r5 stops at its 11th token (or earlier, where that token recurs)
    want = overlap_run(waiting, stop_at)
    assert want["r5"][1] == "stop" and want["r3"][1] is None and len(want["r3"][0]) == 5  # aborted
    assert waiting.runner.steps_ahead == 0 and waiting.blocks.num_free == free
    del waiting
    ahead = engine(True)
    got = overlap_run(ahead, stop_at)
    assert got == want
    assert all(len(toks) == deltas for toks, _, deltas in got.values())
    assert ahead.runner.steps_ahead >= 10  # with requests waiting, only while no place frees up
    assert ahead.blocks.num_free == free


@pytest.mark.gpu
def test_graph_replay_matches_eager_and_padding_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 3 replayed as the size-4 graph: same hidden states as the eager forward, and the
    cache changes only at the 3 real slots (the padding row writes nowhere)."""
    engine = cuda_engine("auto", monkeypatch)
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None and runner.kv_cache is not None
    bs = runner.block_size
    runner.kv_cache.storage.normal_()
    seq_lens = [9, 16, 40]
    tables = [[0], [1], [2, 3, 4]]
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, tables, bs, runner.device)
    ids = torch.tensor([3, 5, 7], device="cuda")
    pos = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    before = runner.kv_cache.storage.clone()
    with torch.inference_mode():
        replayed = graphs.run(ids, pos, meta).clone()
        after_graph = runner.kv_cache.storage.clone()
        eager = runner.model(ids, pos, runner.kv_cache.layers, meta)
    assert padded_size(3) == 4 and graphs.replays == 1
    assert (replayed - eager).abs().max().item() < 1e-4 * eager.abs().max().item()
    with torch.inference_mode():  # the same step again through the output head, in the same replay
        runner.kv_cache.storage.copy_(before)
        logits, greedy = graphs.run_logits(ids, pos, meta)
        want = runner.model.compute_logits(eager)
    assert logits.shape == want.shape == (3, SHAPE["vocab_size"]) and logits.dtype == torch.float32
    assert (logits - want).abs().max().item() < 1e-4 * want.abs().max().item()
    assert torch.equal(greedy, logits.argmax(dim=-1)) and torch.equal(greedy, want.argmax(dim=-1))
    assert graphs.replays == 2
    with torch.inference_mode():  # and from host values, after a larger batch left its rows behind
        graphs.run_host([1] * 6, list(range(6)), [1] * 6, [[5]] * 6)
        runner.kv_cache.storage.copy_(before)
        host_logits, host_greedy = graphs.run_host([3, 5, 7], [n - 1 for n in seq_lens], seq_lens, tables)
        host_logits = host_logits.clone()
    assert torch.equal(host_logits, logits) and torch.equal(host_greedy, greedy)
    assert torch.equal(runner.kv_cache.storage, after_graph)  # same real slots written, padding none
    changed = (after_graph != before).flatten(4).any(-1)  # [layers, k/v, blocks, block offsets]
    expect = torch.zeros_like(changed)
    for n, table in zip(seq_lens, tables):
        expect[:, :, table[(n - 1) // bs], (n - 1) % bs] = True
    assert torch.equal(changed, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [77, 2048, 2500])
def test_attention_layer_fresh_prefill_matches_reference(tokens: int) -> None:
    """The layer's path for one fresh bf16 sequence (Triton when short, cuDNN when long) against the
    torch reference."""
    from ragfuse.engine.attention import Attention
    from ragfuse.kernels.paged_attention import paged_prefill_attention_ref

    heads, kv_heads, d, bs = 32, 8, 128, 16
    attn = Attention(heads, kv_heads, d)
    attn.backend = "triton"
    blocks = -(-tokens // bs)
    k_cache = torch.randn(blocks + 2, bs, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(tokens, heads, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    table = list(range(2, 2 + blocks))
    meta = AttentionMetadata.build([tokens], [tokens], [table], bs, torch.device("cuda"))
    assert attn._cudnn_fits(q, meta) == (tokens >= 2048)
    out, lse = attn(q, k, v, (k_cache, v_cache), meta)
    ref, ref_lse = paged_prefill_attention_ref(
        q.float(), k_cache.float(), v_cache.float(), meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, d**-0.5
    )
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    assert float((lse - ref_lse).abs().max()) < 1e-2


@pytest.mark.gpu
def test_prefill_graph_matches_eager_and_padding_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 120-token prefill, then a 100-token continuation of another sequence, both replayed from the
    128-token bucket (whole, and one graph per layer): hidden states equal the eager forward's, and the
    cache changes only at the real slots (the continuation's padding rows hold the first prefill's
    slots until they are reset)."""
    from ragfuse.engine.cuda_graphs import prefill_bucket

    engine = cuda_engine("auto", monkeypatch)
    runner, graphs = engine.runner, engine.runner.prefill_graphs
    assert graphs is not None and runner.kv_cache is not None
    bs = runner.block_size
    runner.kv_cache.storage.normal_()
    g = torch.Generator().manual_seed(2)
    cases = [  # (query tokens, tokens cached before them, block table)
        (120, 0, list(range(0, 8))),
        (100, 20, list(range(10, 18))),
    ]
    for n, start, table in cases:
        meta = AttentionMetadata.build([n], [start + n], [table], bs, runner.device)
        ids = torch.randint(1, 512, (n,), generator=g).cuda()
        pos = torch.arange(start, start + n, device="cuda")
        before = runner.kv_cache.storage.clone()
        with torch.inference_mode():
            replayed = graphs.run(ids, pos, meta).clone()
            after_graph = runner.kv_cache.storage.clone()
            runner.kv_cache.storage.copy_(before)
            calls: list[int] = []  # one graph per layer, the host called back before each
            layered = graphs.run_layers(ids, pos, meta, calls.append).clone()
            after_layers = runner.kv_cache.storage.clone()
            runner.kv_cache.storage.copy_(before)
            eager = runner.model(ids, pos, runner.kv_cache.layers, meta)
        key = (128, captured_span(start + n, graphs.max_model_len, graphs.split_span))  # short: one key split
        assert prefill_bucket(n) == 128 and set(graphs.graphs) == {(*key, False)} and set(graphs.layer_graphs) == {key}
        assert calls == list(range(SHAPE["num_hidden_layers"]))
        for out in (replayed, layered):
            assert (out - eager).abs().max().item() < 1e-4 * eager.abs().max().item()
        expect = torch.zeros_like((before != before).flatten(4).any(-1))  # [layers, k/v, blocks, block offsets]
        for p in range(start, start + n):
            expect[:, :, table[p // bs], p % bs] = True
        for after in (after_graph, after_layers):
            assert torch.equal((after != before).flatten(4).any(-1), expect)
    assert graphs.replays == 2 and graphs.layer_replays == 2


@pytest.mark.gpu
def test_engine_prefills_through_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts up to the largest bucket are prefilled by graph replay, and generation is unchanged."""
    fast = cuda_engine("auto", monkeypatch)
    graphs = fast.runner.prefill_graphs
    assert graphs is not None
    ps = prompts() + [torch.randint(1, 512, (1010,), generator=torch.Generator().manual_seed(3)).tolist()]
    got = [generate(fast, [p], 8)[0] for p in ps]
    assert graphs.replays == 4 and {key[0] for key in graphs.graphs} == {64, 96, 1024}
    ref = cuda_engine("torch", monkeypatch)
    assert got == [generate(ref, [p], 8)[0] for p in ps]


@pytest.mark.gpu
def test_two_phase_graph_replay_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode over shared blocks replayed from a tree graph: the same hidden states as the eager
    two-phase forward and as plain paged decode, for two plans in turn (the second with fewer items,
    so rows the first left in the plan buffers must be inert); a plan is loaded once, not per step."""
    from ragfuse.kernels.two_phase import build_two_phase_plan

    engine = cuda_engine("auto", monkeypatch)
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None and runner.kv_cache is not None
    mc, bs = engine.model_config, runner.block_size
    runner.kv_cache.storage.normal_()
    seq_lens = [70, 66, 50, 80, 20]
    tables = [[0, 1, 2, 3, 5], [0, 1, 2, 3, 6], [0, 1, 2, 7], [0, 1, 2, 8, 9], [10, 11]]
    cases = [  # (tree paths, split tokens): nested segments split small, then one segment whole
        ([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2], []], 16),
        ([[0, 1], [0, 1], [0, 1], [0, 1], []], None),
    ]
    ids = torch.tensor([3, 5, 7, 9, 11], device="cuda")
    pos = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    for i, (paths, split) in enumerate(cases):
        plan = build_two_phase_plan(paths, bs, mc.num_kv_heads, runner.device, split_tokens=split,
                                    group=mc.num_heads // mc.num_kv_heads, head_dim=mc.head_dim)
        assert plan is not None
        meta = AttentionMetadata.build([1] * 5, seq_lens, tables, bs, runner.device)
        meta.two_phase = plan
        assert graphs.accepts(meta)
        with torch.inference_mode():
            replayed = graphs.run(ids, pos, meta).clone()
            again = graphs.run(ids, pos, meta).clone()
            eager = runner.model(ids, pos, runner.kv_cache.layers, meta)
            meta.two_phase = None
            paged = runner.model(ids, pos, runner.kv_cache.layers, meta)
        assert graphs.tree_replays == 2 * (i + 1) and graphs._loaded[0] is plan
        for got in (replayed, again, paged):
            assert (got - eager).abs().max().item() < 1e-4 * eager.abs().max().item()
    assert (8, 16, 4, False) in graphs.tree_graphs


@pytest.mark.gpu
def test_engine_with_tree_replays_two_phase_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sharing a 40-token prefix (two full blocks) decode by two-phase graph replay and
    give the torch backend's greedy tokens."""
    g = torch.Generator().manual_seed(4)
    common = torch.randint(1, 512, (40,), generator=g).tolist()
    ps = [common + torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 9, 20)]
    want = generate(cuda_engine("torch", monkeypatch), ps, 30)
    fast = cuda_engine("auto", monkeypatch)
    graphs = fast.runner.graphs
    assert graphs is not None and fast.tree is not None
    assert generate(fast, ps, 30) == want
    assert graphs.tree_replays >= 29 and any(key[0] == 4 for key in graphs.tree_graphs)
