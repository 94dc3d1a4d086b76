"""The engine behind registered system prompts: relay attention gives the tokens of plain prefill.

The default model (CPU) on 10 questions behind a 1K-token system prompt, and a small random model
with two system prompts in one batch (multi-application), chunked prefill, and the prefix-shared
path without relay. On CUDA (``gpu``): the Triton kernels with decode graphs against the torch path.
"""

from __future__ import annotations

import json

import pytest
import torch

from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ragfuse.engine.errors import RequestError
from ragfuse.shared_data import shared_data

QUESTIONS = [
    "Who is mentioned first?", "Summarise the first passage.", "What year is given?", "Name one place.",
    "What is the main topic?", "List two people.", "What happened last?", "Is there a river?",
    "Which country is named?", "Give a title for this text.",
]


def knowledge(tokenizer, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of MuSiQue passages: a knowledge document as system prompt."""
    with open(shared_data("musique_dev.json")) as f:
        cases = json.load(f)
    text = "Answer from these passages.\n" + "\n".join(c["text"] for case in cases[:3] for c in case["ctxs"])
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n_tokens])


def test_greedy_tokens_identical_with_and_without_relay(llm) -> None:
    """Relay against the engine without relay (the system prompt's blocks shared, read per request
    by the paged kernel) on all 10 questions, and against plain full prefill on two of them (which
    also checks that the registered KV equals what a full prefill computes)."""
    system = knowledge(llm.tokenizer, 1000)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=6)
    relayed = [llm.relay_chat_ids(c, system) for c in chats]
    sid = relayed[0][0]
    assert sid is not None and all(r[0] == sid for r in relayed)  # registered once, found again
    sp = llm.engine.systems.get(sid)
    system_blocks = len(sp.block_table)
    assert 950 <= sp.num_tokens <= 1100
    free = llm.engine.blocks.num_free
    got = [o.token_ids for o in llm.generate([ids for _, ids in relayed], params, system=sid)]
    assert llm.engine.blocks.num_free == free  # requests held only their own pages
    shared = [o.token_ids for o in llm.generate([ids for _, ids in relayed], params, system=sid, relay=False)]
    assert got == shared
    assert llm.engine.blocks.num_free == free  # the shared blocks' extra references were dropped
    plain = [o.token_ids for o in llm.generate([llm.chat_ids(c, system) for c in chats[:2]], params)]
    assert got[:2] == plain
    llm.engine.release_system(sid)
    assert llm.engine.blocks.num_free == free + system_blocks


def test_generate_command_uses_relay_unless_told_not_to(capsys: pytest.CaptureFixture[str]) -> None:
    from ragfuse.cli import main  # the command's entry point in this process (test_cli runs the executable)

    def generate(*extra: str) -> dict:
        capsys.readouterr()
        assert main(["generate", "Name a colour.", "--system", "You answer in one word.", "--max-tokens", "5",
                     "--json", "--device", "cpu", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    relayed, plain = generate(), generate("--no-relay")
    assert relayed["relay"] is True and plain["relay"] is False
    assert relayed["token_ids"] == plain["token_ids"]


SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 0,
}


def small_engine(device: str = "cpu", **options) -> LLMEngine:
    cfg = EngineConfig(device=device, dtype="float32", block_size=8, kv_cache_bytes=8 << 20, **options)
    engine = LLMEngine(cfg, random_weights=ModelConfig.from_dict(SHAPE))
    with torch.no_grad():
        engine.runner.model.lm_head.weight.mul_(30.0)  # well separated top logits: no ties decide a token
    return engine


def run_all(engine: LLMEngine, requests: list[tuple[list[int], int | None, bool]], n: int) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), system=s, relay=r)
           for p, s, r in requests]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def workload() -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """Two system prompts (one ending mid-block) and requests behind either one or neither."""
    g = torch.Generator().manual_seed(3)
    systems = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (45, 64)]
    requests = [(torch.randint(1, 256, (n,), generator=g).tolist(), s) for n, s in
                [(5, 0), (13, 1), (1, 0), (30, -1), (9, 1), (17, 0)]]
    return systems, requests


@pytest.mark.parametrize("chunk", [8192, 11])
def test_relay_multi_application_batch_matches_full_prompts(chunk) -> None:
    engine = small_engine(max_num_batched_tokens=chunk)
    systems, requests = workload()
    want = run_all(engine, [((systems[s] if s >= 0 else []) + p, None, True) for p, s in requests], 12)
    sids = [engine.register_system(s) for s in systems]
    assert engine.register_system(systems[1]) == sids[1]
    for relay in (True, False):
        got = run_all(engine, [(p, sids[s] if s >= 0 else None, relay) for p, s in requests], 12)
        assert got == want, relay


def test_relay_bad_input_is_refused() -> None:
    engine = small_engine()
    with pytest.raises(RequestError):
        engine.add_request([1, 2], system=5)
    sid = engine.register_system([1 + i % 200 for i in range(499)])
    with pytest.raises(RequestError):
        engine.add_request(list(range(1, 20)), system=sid)  # 499 + 19 > 512 tokens of context
    with pytest.raises(RequestError):
        engine.register_system([1 + i % 200 for i in range(600)])
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), system=sid)
    with pytest.raises(RequestError):
        engine.release_system(sid)  # a request still follows it
    while engine.has_unfinished():
        engine.step()
    engine.release_system(sid)


@pytest.mark.gpu
def test_relay_triton_with_graphs_matches_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    systems, requests = workload()
    monkeypatch.setenv("RAGFUSE_KERNELS", "torch")
    ref = small_engine("cuda")
    want = run_all(ref, [((systems[s] if s >= 0 else []) + p, None, True) for p, s in requests], 30)
    del ref
    monkeypatch.setenv("RAGFUSE_KERNELS", "auto")
    fast = small_engine("cuda")
    assert fast.runner.attention_backend_name == "triton" and fast.runner.graphs is not None
    sids = [fast.register_system(s) for s in systems]
    got = run_all(fast, [(p, sids[s] if s >= 0 else None, True) for p, s in requests], 30)
    assert got == want
    graphs = fast.runner.graphs
    assert graphs.relay_graphs and graphs.replays >= 29
    assert graphs.host_replays >= 29  # relay steps sent from host values (DecodeGraphs.run_host)


@pytest.mark.gpu
def test_relay_prefill_of_one_request_replays_a_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving one by one are prefilled alone: behind a system prompt that prefill replays a
    graph with the system part (it ran eagerly before), and gives the torch path's tokens."""
    systems, requests = workload()
    monkeypatch.setenv("RAGFUSE_KERNELS", "torch")
    ref = small_engine("cuda")
    want = [run_all(ref, [((systems[s] if s >= 0 else []) + p, None, True)], 12)[0] for p, s in requests]
    del ref
    monkeypatch.setenv("RAGFUSE_KERNELS", "auto")
    fast = small_engine("cuda")
    sids = [fast.register_system(s) for s in systems]
    graphs = fast.runner.prefill_graphs
    assert graphs is not None and graphs.relay_replays == 0
    got = [run_all(fast, [(p, sids[s] if s >= 0 else None, True)], 12)[0] for p, s in requests]
    assert got == want
    assert graphs.relay_replays == sum(s >= 0 and len(p) > 1 for p, s in requests)  # 1 token: a decode step


@pytest.mark.gpu
def test_relay_with_tree_graphs_matches_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests behind one system prompt that also share a 20-token prefix of their own: two-phase
    decode merged with the relay system part, replayed from a graph, gives the torch path's tokens."""
    systems, _ = workload()
    g = torch.Generator().manual_seed(5)
    common = torch.randint(1, 256, (20,), generator=g).tolist()
    ps = [common + torch.randint(1, 256, (n,), generator=g).tolist() for n in (2, 7, 15)]
    monkeypatch.setenv("RAGFUSE_KERNELS", "torch")
    want = run_all(small_engine("cuda"), [(systems[0] + p, None, True) for p in ps], 30)
    monkeypatch.setenv("RAGFUSE_KERNELS", "auto")
    fast = small_engine("cuda")
    sid = fast.register_system(systems[0])
    assert run_all(fast, [(p, sid, True) for p in ps], 30) == want
    graphs = fast.runner.graphs
    assert graphs is not None and graphs.tree_replays >= 29 and any(key[3] for key in graphs.tree_graphs)


def test_relay_prompts_registered_on_demand_are_bounded_and_released_lru(engine) -> None:
    """The registry behind server chats: same tokens -> same id; at the bound the least recently
    used prompt without unfinished requests is released; all busy -> no relay (None)."""
    from ragfuse.engine.relay_prompts import RelayPrompts

    reg = RelayPrompts(engine, max_prompts=2)
    a, b, c, d = ([1000 + i] * 20 for i in range(4))
    free = engine.blocks.num_free
    sa = reg.acquire(a)
    assert reg.acquire(b) not in (None, sa)
    assert reg.acquire(a) == sa and reg.reuses == 1 and reg.registered == 2
    sc = reg.acquire(c)  # b is the least recently used now
    assert engine.systems.find(b) is None and engine.systems.find(a) == sa and reg.releases == 1
    busy = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), system=s) for s in (sa, sc)]
    assert reg.acquire(d) is None and reg.registered == 2  # both in use: the caller serves it without relay
    for rid in busy:
        engine.abort(rid)
    sd = reg.acquire(d)
    assert sd is not None and engine.systems.find(a) is None and reg.releases == 2  # a was used before c
    engine.release_system(sd)  # released behind the registry's back: it notices
    assert reg.registered == 1
    busy = engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), system=sc)
    assert reg.release_idle() == 0  # a running request keeps its prompt
    engine.abort(busy)
    assert reg.release_idle() == 1 and reg.registered == 0 and engine.blocks.num_free == free


def test_idle_on_demand_system_prompts_give_their_blocks_to_waiting_requests() -> None:
    """Chats with long system prompts leave them registered (``relay_prompts``) after they end; a
    later request that needs those blocks must get them, not wait forever with nothing running.
    A prompt that cannot fit even then is served without relay (None), not refused."""
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=8, kv_cache_bytes=160 * 4096)
    engine = LLMEngine(cfg, random_weights=ModelConfig.from_dict(SHAPE))
    assert engine.blocks.num_blocks == 160
    prompts = [[1 + (i * 7 + j) % 200 for j in range(400)] for i in range(3)]  # 50 blocks each
    for p in prompts:
        sid = engine.relay_prompts.acquire(p)
        assert sid is not None
        run_all(engine, [([5, 6, 7], sid, True)], 2)
    assert engine.blocks.num_free == 10 and engine.relay_prompts.registered == 3
    plain = [1 + j % 250 for j in range(300)]  # 38 blocks with its answer
    steps = 0
    rid = engine.add_request(plain, SamplingParams(max_tokens=4, ignore_eos=True))
    finished = False
    while engine.has_unfinished() and steps < 50:
        finished |= any(o.finished and o.request_id == rid for o in engine.step())
        steps += 1
    assert finished, "the request never got the idle prompts' blocks"
    assert engine.relay_prompts.releases == 1  # the least recently used one was enough
    assert engine.systems.find(prompts[0]) is None and engine.systems.find(prompts[2]) is not None
    busy = [engine.add_request([5, 6], SamplingParams(max_tokens=50, ignore_eos=True), system=engine.systems.find(p))
            for p in prompts[1:]]
    huge = [1 + j % 230 for j in range(500)]  # 63 blocks: more than are free, and no prompt is idle
    assert engine.relay_prompts.acquire(huge) is None
    for rid in busy:
        engine.abort(rid)
    assert engine.relay_prompts.acquire(huge) is not None


def test_on_demand_registry_never_releases_a_prompt_the_application_registered() -> None:
    """An id from ``register_system`` is the application's until it releases it: a relay chat whose
    system message has the same tokens reuses it, but the registry must not release it for room
    (the id would then name another prompt, and the application's requests would silently continue
    that one), nor a prompt it registered first that the application then registers too."""
    engine = small_engine()
    reg = engine.relay_prompts
    app = [1 + j % 200 for j in range(30)]
    sid = engine.register_system(app)
    assert reg.acquire(app) == sid
    shared = [201 + j % 50 for j in range(20)]
    assert engine.register_system(shared) == reg.acquire(shared)  # the registry's first, then the app's too
    for k in range(engine.systems.capacity):  # other chats' prompts arrive, more than fit
        reg.acquire([100 + k] * 12)
    assert reg.releases > 0 and reg.release_idle() > 0
    assert engine.systems.find(app) == sid and engine.systems.get(sid).token_ids == app
    assert engine.systems.find(shared) is not None
    user = [40, 41, 42]
    assert run_all(engine, [(user, sid, True)], 6) == run_all(small_engine(), [(app + user, None, True)], 6)


RANDOM_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "eos_token_id": 0,
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode,ratio", [("reuse", 0.0), ("fuse", 0.15)])
def test_fused_prompt_behind_a_relay_system_prompt_equals_the_stored_prefix(device, mode, ratio) -> None:
    """A fused prompt (stored chunks, selective recompute) behind a registered system prompt, in
    the fused prefill and in decode, gives the tokens of the same system prompt as the prompt's
    first segment with its stored KV (an exact prefix in the request's pages). On CUDA through
    the Triton kernels (system part, merge), on CPU through the torch references."""
    from ragfuse.engine.fusion import Segment, SelectionPolicy, TensorKV

    cfg = EngineConfig(device=device, dtype="float32", kv_cache_bytes=64 << 20,
                       attention_backend="triton" if device == "cuda" else "torch")
    eng = LLMEngine(cfg, random_weights=ModelConfig.from_dict(RANDOM_SHAPE))
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (90, 130, 77)]
    segs = [Segment(p, TensorKV(*kv)) for p, kv in zip(pieces, eng.compute_kv(pieces), strict=True)]
    segs.append(Segment([5, 6, 7, 8, 9]))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    policy = SelectionPolicy(ratio=ratio)

    def tokens(rid: str) -> list[int]:
        while True:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out.token_ids

    stored_rid, stored = eng.add_fused_request(segs, params, mode, policy)
    want = tokens(stored_rid)
    sid = eng.register_system(pieces[0])
    relay_rid, relayed = eng.add_fused_request(segs[1:], params, mode, policy, system=sid)
    assert tokens(relay_rid) == want
    assert relayed.recomputed_tokens == stored.recomputed_tokens and relayed.prompt_tokens == stored.prompt_tokens - 90
