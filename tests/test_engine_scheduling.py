"""Continuous batching, preemption, sampling, stop strings, streaming and the async loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from ragfuse.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, RequestError, SamplingParams
from ragfuse.engine.block_manager import BlockManager

RANDOM_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 0,
}


def random_engine(kv_blocks: int, block_size: int = 4, **kw) -> LLMEngine:
    from ragfuse.engine import ModelConfig

    mc = ModelConfig.from_dict(RANDOM_SHAPE)
    per_block = mc.kv_bytes_per_token(torch.float32) * block_size
    cfg = EngineConfig(device="cpu", block_size=block_size, kv_cache_bytes=kv_blocks * per_block, **kw)
    return LLMEngine(cfg, random_weights=mc)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(1, 128, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def test_block_manager_refcounts_and_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    a: list[int] = []
    bm.grow(a, 3)
    assert len(a) == 2 and bm.num_free == 2
    shared = bm.share(a[:1])
    bm.release(a)
    assert bm.num_free == 3  # the shared block still has a user
    bm.release(shared)
    assert bm.num_free == 4
    with pytest.raises(RequestError):
        bm.grow([], 9)
    with pytest.raises(ValueError):
        bm.share([0])


def test_blocks_ahead_for_an_overlapped_step_are_all_or_none():
    """A decode step launched before its predecessor's tokens are read takes a block for each
    sequence's next token only where every sequence gets one (else the engine waits and schedules)."""
    from ragfuse.engine.scheduler import Scheduler
    from ragfuse.engine.sequence import Sequence

    bm = BlockManager(num_blocks=5, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [Sequence(f"r{i}", [1] * 4, SamplingParams()) for i in range(2)]
    for seq in seqs:
        bm.grow(seq.block_table, 4)
        seq.num_computed_tokens = 4  # a full block each: the next token needs a new one
    bm.grow([], 4)  # another user leaves 2 blocks
    assert sched.grow_ahead(seqs) and [len(s.block_table) for s in seqs] == [2, 2] and bm.num_free == 0
    for seq in seqs:
        seq.num_computed_tokens = 5
    assert sched.grow_ahead(seqs)  # room in their blocks: nothing taken
    for seq in seqs:
        seq.num_computed_tokens = 8
    bm.release(seqs[0].block_table[1:2])  # one block free, two needed
    seqs[0].block_table.pop()
    assert not sched.grow_ahead(seqs) and bm.num_free == 1 and len(seqs[1].block_table) == 2


def test_preemption_under_memory_pressure_keeps_outputs_identical():
    """With a cache too small for all sequences at once, the newest is preempted and recomputed;
    greedy outputs stay those of an unconstrained run."""
    ps = prompts(6, 10)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = LLM.from_engine(random_engine(kv_blocks=400)).generate(ps, params)
    tight_engine = random_engine(kv_blocks=30)
    tight = LLM.from_engine(tight_engine).generate(ps, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(o.metrics["preemptions"] for o in tight) > 0
    assert tight_engine.blocks.num_free == tight_engine.blocks.num_blocks


def test_requests_join_and_leave_while_others_decode():
    eng = random_engine(kv_blocks=200)
    short = eng.add_request(prompts(1, 5)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    long = eng.add_request(prompts(1, 9)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    finished_at: dict[str, int] = {}
    late = None
    for step in range(100):
        for out in eng.step():
            if out.finished:
                finished_at[out.request_id] = step
        if step == 4:
            late = eng.add_request(prompts(1, 7)[0], SamplingParams(max_tokens=4, ignore_eos=True))
        if not eng.has_unfinished():
            break
    assert finished_at[short] < finished_at[long]
    assert late in finished_at and finished_at[late] < finished_at[long]  # joined mid-flight, left early


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(llm):
    ids = llm.chat_ids([{"role": "user", "content": "Tell me a story about a dragon."}])
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = llm.generate([ids, ids], [p, p])
    assert a.token_ids == b.token_ids
    c = llm.generate([ids], SamplingParams(**{**p.__dict__, "seed": 8}))[0]
    greedy = llm.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids or greedy.token_ids != a.token_ids
    k1 = llm.generate([ids], SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=3, ignore_eos=True))[0]
    assert k1.token_ids == greedy.token_ids  # top-k 1 is greedy


def test_stop_strings_cut_text_and_stream_never_shows_it(llm):
    ids = llm.chat_ids([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    full = llm.generate([ids], SamplingParams(max_tokens=60))[0].text
    assert "5" in full
    stop = full[full.index("5") : full.index("5") + 2]
    chunks = [o.delta_text for o in llm.stream(ids, SamplingParams(max_tokens=60, stop=[stop]))]
    streamed = "".join(chunks)
    assert stop not in streamed
    assert streamed == full[: full.index(stop)]


def test_stream_equals_generate_and_abandoning_a_stream_frees_blocks(llm):
    ids = llm.chat_ids([{"role": "user", "content": "What is the tallest mountain?"}])
    params = SamplingParams(max_tokens=30)
    outs = list(llm.stream(ids, params))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text == llm.generate([ids], params)[0].text
    free = llm.engine.blocks.num_free
    it = llm.stream(ids, SamplingParams(max_tokens=30, ignore_eos=True))
    next(it)
    it.close()
    assert llm.engine.blocks.num_free == free


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure if it has not returned in ``seconds`` (a deadlock or a stream
    waiting for outputs someone else consumed would otherwise hang the suite)."""
    import threading

    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"no result in {seconds} s"
    return box[0]


def test_open_streams_and_calls_interleave_on_one_thread():
    """A stream read halfway, then other calls on the same engine (another stream, a batch), then the
    rest of the stream: each gets exactly its own tokens, as when run alone."""
    ps = prompts(3, 10)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in LLM.from_engine(random_engine(kv_blocks=300)).generate(ps, params)]
    llm = LLM.from_engine(random_engine(kv_blocks=300))

    def interleaved() -> list[list[int]]:
        first, second = llm.stream(ps[0], params), llm.stream(ps[1], params)
        head = next(first)
        batch = llm.generate([ps[2]], params)[0]
        rest = list(second)
        tail = list(first)
        return [[*head.delta_token_ids, *(t for o in tail for t in o.delta_token_ids)],
                rest[-1].token_ids, batch.token_ids]

    assert _within(60, interleaved) == alone
    abandoned = llm.stream(ps[0], SamplingParams(max_tokens=100, ignore_eos=True))
    next(abandoned)
    abandoned.close()  # a consumer that stops early: its request is aborted, its blocks freed
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_bad_requests_are_refused_clearly(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("")
    for bad in ([10**9], [-1], [1, 2.5], [1, "2"]):
        with pytest.raises(RequestError, match="vocabulary"):
            engine.add_request(bad)
    with pytest.raises(RequestError, match="exceeds"):
        engine.add_request([1] * (engine.max_model_len + 1))
    with pytest.raises(RequestError):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError):
        SamplingParams(top_p=0)


def test_generate_is_all_or_none_and_numbers_requests_past_the_callers_ids():
    """A bad prompt among good ones refuses the whole call and leaves nothing running (the good ones,
    already queued, would otherwise hold cache blocks untracked); ids the engine numbers skip the
    ones callers chose (a caller's own "req-1" must not make later calls without ids fail)."""
    eng = random_engine(kv_blocks=100)
    llm = LLM.from_engine(eng)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[4, 5, 6], [7, 8], []], params)
    assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.num_blocks
    with pytest.raises(RequestError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [params, params])
    mine = [eng.add_request([1, 2, 3], params, request_id=f"req-{i}") for i in range(3)]
    outs = llm.generate([[4, 5], [6, 7]], SamplingParams(max_tokens=2))
    assert len(outs) == 2 and not {o.request_id for o in outs} & set(mine)
    for rid in mine:
        eng.abort(rid)
    for rid in ("req-9", "async-3"):  # ids like the ones the engine (or the async front end) numbers
        eng.add_request([1, 2, 3], params, request_id=rid)
    aeng = AsyncEngine(eng)

    async def main():
        finished = []
        for _ in range(12):
            outs = [o async for o in aeng.generate([4, 5], SamplingParams(max_tokens=2))]
            finished.append(outs[-1].finished)
        return finished

    try:
        assert all(asyncio.run(main()))
    finally:
        aeng.shutdown()


def test_async_engine_serves_concurrent_callers_and_cancels():
    eng = random_engine(kv_blocks=300)
    aeng = AsyncEngine(eng)
    ps = prompts(5, 8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in LLM.from_engine(random_engine(kv_blocks=300)).generate(ps, params)]

    async def collect(p):
        last = None
        async for out in aeng.generate(p, params):
            last = out
        return last.token_ids

    async def cancel_one():
        agen = aeng.generate(ps[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()  # a client that disconnects

    async def main():
        got = await asyncio.gather(*(collect(p) for p in ps), cancel_one())
        with pytest.raises(RequestError):
            await collect([])
        return got[:-1]

    try:
        assert asyncio.run(main()) == expected
        for _ in range(100):
            if not eng.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
        assert eng.blocks.num_free == eng.blocks.num_blocks
    finally:
        aeng.shutdown()


def test_a_step_runs_between_two_calls_while_a_stream_runs():
    """Calls queued back to back (an upload's KV batches, each long) take turns with decode steps:
    a running stream gets a token after each call, not only after the whole series."""
    eng = random_engine(kv_blocks=300)
    aeng = AsyncEngine(eng)
    release = threading.Event()
    seen: list[int] = []

    def generated(engine: LLMEngine) -> int:
        return sum(len(s.output_token_ids) for s in engine.scheduler.running)

    def first(engine: LLMEngine) -> None:
        release.wait(10)  # the second call is queued meanwhile
        seen.append(generated(engine))

    async def main() -> None:
        stream = aeng.generate(prompts(1, 8)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        one = asyncio.ensure_future(aeng.call(first))
        await asyncio.sleep(0.05)
        two = asyncio.ensure_future(aeng.call(lambda e: seen.append(generated(e))))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(one, two)
        await stream.aclose()

    try:
        asyncio.run(main())
    finally:
        aeng.shutdown()
    assert seen[1] > seen[0] > 0, seen


def test_a_start_waiting_for_room_is_tried_again_only_once_blocks_are_freed():
    """``LLMEngine.when_room`` (a session turn or a RAG question on a full cache, sync callers): the
    start (retrieval, session lookup, stored KV opened) is repeated only after a step that freed
    blocks, not at every step of the requests holding the cache; their outputs are all handed on."""
    from ragfuse.engine.fusion import FusionMode, Segment

    eng = random_engine(kv_blocks=40)
    plain = eng.add_request(prompts(1, 60)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    first = eng.step()
    attempts: list[int] = []

    def start() -> str:
        attempts.append(eng.blocks.num_free)
        rid, _ = eng.add_fused_request([Segment(prompts(1, 104)[0])], SamplingParams(max_tokens=3, ignore_eos=True),
                                       FusionMode.FULL)
        return rid

    fused = eng.when_room(start)
    assert len(attempts) == 2 and attempts[1] == eng.blocks.num_blocks
    last = {out.request_id: out for out in first}
    while eng.has_unfinished():
        last |= {out.request_id: out for out in eng.step()}
    assert {rid: (len(out.token_ids), out.finished) for rid, out in last.items()} == {plain: (40, True),
                                                                                      fused: (3, True)}


def test_async_engine_holds_a_fused_start_until_the_cache_has_room():
    """A fused prefill takes its blocks when it starts; with the cache busy it must wait for room
    (not fail: the client did nothing wrong), in order, and one cancelled while it waits never starts."""
    from ragfuse.engine.fusion import FusionMode, Segment

    eng = random_engine(kv_blocks=40)
    aeng = AsyncEngine(eng)
    long_plain = prompts(1, 60)[0]  # 15 blocks, 25 by its last token
    fused_ids = prompts(1, 104)[0]  # 26 blocks: no room until the plain request ends
    started: list[str] = []
    attempts: list[str] = []

    def start_fused(engine: LLMEngine, tag: str) -> str:
        attempts.append(tag)
        rid, _ = engine.add_fused_request([Segment(fused_ids)], SamplingParams(max_tokens=3, ignore_eos=True),
                                          FusionMode.FULL)
        started.append(tag)
        return rid

    async def tokens(agen) -> list[int]:
        last = None
        async for out in agen:
            last = out
        return last.token_ids

    async def main():
        plain = aeng.generate(long_plain, SamplingParams(max_tokens=40, ignore_eos=True))
        first = await plain.__anext__()
        # the engine thread is held between steps while both starts are queued and one is cancelled:
        # under load the plain request could otherwise end (and free room) before the cancel
        hold = threading.Event()
        held = asyncio.create_task(aeng.call(lambda e: hold.wait(30)))
        fused = asyncio.create_task(tokens(aeng.generate_with(lambda e: start_fused(e, "kept"))))
        dropped = asyncio.create_task(tokens(aeng.generate_with(lambda e: start_fused(e, "cancelled"))))
        await asyncio.sleep(0.05)  # the loop runs both tasks up to their first wait (their starts queued)
        dropped.cancel()
        await asyncio.sleep(0.05)  # the cancelled one queues its abort behind its start
        hold.set()
        assert await held
        rest = await tokens(plain)
        return first, rest, await fused

    try:
        _first, rest, fused = asyncio.run(main())
        assert len(rest) == 40 and len(fused) == 3 and started == ["kept"]
        assert attempts == ["kept", "kept"]  # tried again once the plain request freed its blocks, not per step
        for _ in range(100):
            if not eng.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
        assert eng.blocks.num_free == eng.blocks.num_blocks and aeng.queue_depth == 0
    finally:
        aeng.shutdown()


def test_gpu_memory_share_comes_from_the_environment_and_is_checked(monkeypatch):
    """Processes sharing one GPU each lower their KV share through the environment; a share outside (0, 1] fails."""
    from ragfuse.engine.errors import ModelError

    monkeypatch.setenv("RAGFUSE_GPU_MEMORY_UTILIZATION", "0.05")
    assert EngineConfig().gpu_memory_utilization == 0.05
    assert EngineConfig(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    with pytest.raises(ModelError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    monkeypatch.setenv("RAGFUSE_GPU_MEMORY_UTILIZATION", "0")
    with pytest.raises(ModelError, match="gpu_memory_utilization"):
        EngineConfig()
