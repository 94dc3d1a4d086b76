"""``ragfuse ask`` end to end: ingest the demo documents, then answer from their stored KV."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ragfuse.engine import SamplingParams
from ragfuse.engine.kvstore import DiskTier
from tests.store_helpers import ingest_demo

QUESTION = "When was the Hollowpoint lighthouse electrified?"


@pytest.fixture(scope="module")
def store(tmp_path_factory, engine):
    """The demo documents ingested (chunks, embeddings, per-chunk KV) with the shared engine."""
    return ingest_demo(tmp_path_factory.mktemp("store"), engine)


@pytest.fixture(scope="module")
def pipeline(store, engine):
    from ragfuse.app import open_pipeline

    return open_pipeline(str(store), engine=engine, gate=False)


def test_fused_answer_at_ratio_one_matches_full_and_loads_nothing(pipeline):
    """Ratio 1 (the controller's choice when loading is slower than recomputing) is full prefill:
    the same answer, without loading chunk KV it would only recompute."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=24)
    fused = pipeline.ask(QUESTION, mode="fuse", ratio=1.0, top_k=2, params=params)
    full = pipeline.ask(QUESTION, mode="full", top_k=2, params=params)
    assert "1952" in full.answer
    assert fused.answer == full.answer  # ratio 1: exactly full prefill
    assert "lighthouses.md" in fused.sources[0]["source"]
    assert not set(fused.tiers) & {"disk", "cpu", "gpu", "redis"}  # the instruction prefix comes by relay
    assert full.tiers == [] and full.reused_tokens == 0
    assert fused.prompt_tokens == full.prompt_tokens


def test_reuse_modes_report_what_they_reused(pipeline):
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    reuse = pipeline.ask(QUESTION, mode="reuse", top_k=3, params=params)
    prefix = pipeline.ask(QUESTION, mode="prefix", top_k=3, params=params)
    fuse = pipeline.ask(QUESTION, mode="fuse", ratio=0.2, top_k=3, params=params)
    assert reuse.recomputed_tokens == 0 and reuse.reused_tokens > 300
    assert prefix.reused_tokens == len(pipeline.builder.prefix)  # the instruction prefix only
    assert 0.19 < fuse.recompute_ratio < 0.25 and fuse.recomputed_tokens > 0


@pytest.mark.parametrize("mode,ratio", [("fuse", 0.3), ("reuse", None)])
def test_instruction_prefix_runs_through_relay_with_the_tokens_of_its_stored_copy(pipeline, mode, ratio):
    """The fixed instruction prefix as a relay system prompt (registered once, in the registry's
    blocks) gives the greedy tokens of the same prefix reused from its stored KV in the pages."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=16)
    off = pipeline.ask(QUESTION, mode=mode, ratio=ratio, top_k=2, params=params, relay=False)
    pipeline.engine.relay_prompts.release_idle()  # an earlier question's registration goes
    first = pipeline.ask(QUESTION, mode=mode, ratio=ratio, top_k=2, params=params)
    on = pipeline.ask(QUESTION, mode=mode, ratio=ratio, top_k=2, params=params)
    assert pipeline.relay and on.token_ids == off.token_ids == first.token_ids
    assert on.relay_system_tokens == len(pipeline.builder.prefix) and off.relay_system_tokens == 0
    assert "relay" in on.tiers and "relay" not in off.tiers
    assert (on.prompt_tokens, on.reused_tokens, on.recomputed_tokens) == (
        off.prompt_tokens, off.reused_tokens, off.recomputed_tokens)
    # the question that registered the prefix computed its KV: counted as computed, not as reused
    assert (first.prompt_tokens, first.reused_tokens) == (on.prompt_tokens, on.reused_tokens - on.relay_system_tokens)
    reuses = pipeline.engine.relay_prompts.reuses
    again = pipeline.ask("Who kept the lighthouse?", mode=mode, ratio=ratio, top_k=2, params=params)
    assert again.relay_system_tokens == len(pipeline.builder.prefix)
    assert pipeline.engine.relay_prompts.reuses == reuses + 1  # the prefix stays registered


def test_a_stream_read_halfway_does_not_block_the_next_question(pipeline):
    """A framework's stream left open (LangChain ``stream`` then ``invoke`` on one thread) used to
    hold the engine's lock and deadlock the next call; now both answer, each its own tokens."""
    import threading

    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=12)
    alone = pipeline.ask(QUESTION, mode="fuse", ratio=0.3, top_k=2, params=params).answer
    other = "How many panels does the Kessel Valley solar farm have?"
    other_alone = pipeline.ask(other, mode="fuse", ratio=0.3, top_k=2, params=params).answer
    got: list[str] = []

    def interleaved() -> None:
        stream = pipeline.stream(QUESTION, mode="fuse", ratio=0.3, top_k=2, params=params)
        next(stream)
        got.append(pipeline.ask(other, mode="fuse", ratio=0.3, top_k=2, params=params).answer)
        got.append(list(stream)[-1].answer)

    worker = threading.Thread(target=interleaved, daemon=True)
    worker.start()
    worker.join(120)
    assert got == [other_alone, alone]


def test_a_question_that_finds_the_cache_full_waits_for_room(pipeline, store):
    """A fused prefill takes its cache blocks when it starts. With the cache held by another caller's
    open stream, ``ask`` raised CacheFullError (a framework's second thread failed for no fault of
    its own); it must wait for room, stepping the stream meanwhile, and both answer as they do alone."""
    import gc

    from ragfuse.app import open_pipeline
    from ragfuse.engine import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=8)
    other = "How many panels does the Kessel Valley solar farm have?"
    alone = pipeline.ask(QUESTION, mode="fuse", ratio=0.3, top_k=2, params=params)
    other_alone = pipeline.ask(other, mode="fuse", ratio=0.3, top_k=2, params=params)
    shared = pipeline.engine
    block_tokens = shared.config.block_size
    per_block = (1 << 30) // shared.blocks.num_blocks  # the shared engine's cache: 1 GiB on CPU
    need = -(-max(alone.prompt_tokens, other_alone.prompt_tokens) // block_tokens) + 1
    small = LLMEngine(EngineConfig(model=shared.config.model, device="cpu", kv_cache_bytes=need * 3 // 2 * per_block))
    try:
        pipe = open_pipeline(str(store), engine=small, gate=False)
        stream = pipe.stream(QUESTION, mode="fuse", ratio=0.3, top_k=2, params=params)
        next(stream)
        assert small.blocks.num_free * block_tokens < other_alone.prompt_tokens - other_alone.relay_system_tokens
        waited = pipe.ask(other, mode="fuse", ratio=0.3, top_k=2, params=params)
        assert (waited.answer, waited.token_ids) == (other_alone.answer, other_alone.token_ids)
        assert list(stream)[-1].token_ids == alone.token_ids
        assert not small.has_unfinished() and small.relay_prompts.release_idle() == 1  # the instruction prefix
        assert small.blocks.num_free == small.blocks.num_blocks
    finally:
        del small
        gc.collect()


def test_corrupt_entry_is_recomputed_not_served(pipeline):
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=16)
    before = pipeline.ask(QUESTION, mode="fuse", ratio=0.5, top_k=1, params=params)
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    for tier in pipeline.store.kv.tiers:  # force the next read to come from disk
        if not tier.persistent:
            for key in list(disk.entry_keys()):
                tier.delete(key)
    chunk_key = pipeline.store.docs.chunks([h["id"] for h in before.sources])[before.sources[0]["id"]].kv_key
    path = disk.path_of(chunk_key)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # flip bits inside the last layer
    path.write_bytes(bytes(data))
    after = pipeline.ask(QUESTION, mode="fuse", ratio=0.5, top_k=1, params=params)
    assert any("checksum" in n for n in after.notes)
    # it was stored, only damaged: the recompute's note does not say it "was not stored"
    assert not any("not stored" in n for n in after.notes), after.notes
    assert after.answer == before.answer
    assert disk.stats().corrupt >= 1


def _first_chunk_key(pipeline, result) -> str:
    return pipeline.store.docs.chunks([result.sources[0]["id"]])[result.sources[0]["id"]].kv_key


def test_a_full_disk_costs_the_stored_copy_not_the_answer(pipeline):
    """A missing chunk's KV is computed; when the disk has no room for it the answer still comes,
    and the notes say it was not kept (the tier's real free-space check, with its reserve raised)."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    key = _first_chunk_key(pipeline, first)
    for tier in pipeline.store.kv.tiers:
        tier.delete(key)
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    reserve, disk.reserve_bytes = disk.reserve_bytes, 1 << 62
    try:
        again = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    finally:
        disk.reserve_bytes = reserve
    assert again.token_ids == first.token_ids
    assert any("storing it failed" in n and "no room on disk" in n for n in again.notes)
    assert not disk.contains(key)
    pipeline.store.kv.put(pipeline.store.kv.get(key))  # the computed copy (kept in memory) reaches the disk now
    assert disk.contains(key)


def test_an_unreadable_entry_is_recomputed_and_left_in_place(pipeline):
    """An entry the disk cannot read (here its file is a directory: the open fails with an OS error)
    is recomputed for the request; unlike a corrupt one it is not dropped, and reads again once fixed."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    key = _first_chunk_key(pipeline, first)
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    for tier in pipeline.store.kv.tiers:  # the next read comes from disk
        if not tier.persistent:
            tier.delete(key)
    path = disk.path_of(key)
    data = path.read_bytes()
    corrupt = disk.stats().corrupt
    path.unlink()
    path.mkdir()
    try:
        again = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    finally:
        path.rmdir()
        path.write_bytes(data)
    assert again.token_ids == first.token_ids
    assert any("could not be read" in n for n in again.notes)
    assert disk.get(key) is not None and disk.stats().corrupt == corrupt


def test_chunk_kv_is_found_as_ingest_stored_it_and_a_missing_entry_computed_the_same_way(pipeline):
    """The pipeline keys a chunk's KV as ingest did (after the instruction prefix, the store's
    setting), so stored chunks load without recompute; a missing entry is computed after the same
    prefix, stored under the same key, and served."""
    import torch

    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=2, params=params)
    assert not any("not stored" in n for n in first.notes)
    chunk = pipeline.store.docs.chunks([first.sources[0]["id"]])[first.sources[0]["id"]]
    for tier in pipeline.store.kv.tiers:
        tier.delete(chunk.kv_key)
    again = pipeline.ask(QUESTION, mode="reuse", top_k=2, params=params)
    assert [n for n in again.notes if "not stored" in n] == [
        f"KV of {len(chunk.token_ids)} tokens was not stored: computed and stored now"]
    assert again.token_ids == first.token_ids
    entry = pipeline.store.kv.get(chunk.kv_key)
    (k, v), = pipeline.engine.compute_kv([list(chunk.token_ids)], context=pipeline.builder.prefix)
    assert torch.allclose(entry.kv()[0], k, atol=1e-5) and torch.allclose(entry.kv()[1], v, atol=1e-5)


def test_stored_kv_of_another_length_is_dropped_and_replaced(pipeline):
    """An intact entry under a chunk's key that does not hold the chunk's tokens (here one short) is
    dropped from every tier as corrupt and replaced by the recomputed KV, which the next question
    loads (it was recomputed but left in place: the put found the key stored, every ask recomputed)."""
    from ragfuse.engine import SamplingParams
    from ragfuse.engine.kvstore import StoredKV

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    key = _first_chunk_key(pipeline, first)
    good = pipeline.store.kv.get(key)
    for tier in pipeline.store.kv.tiers:
        tier.delete(key)
    k, v = good.kv()
    pipeline.store.kv.put(StoredKV.from_kv(key, k[:, :-1], v[:, :-1]))
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    corrupt = disk.stats().corrupt
    again = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    assert again.token_ids == first.token_ids
    assert disk.stats().corrupt == corrupt + 1
    assert any(n.startswith(f"KV entry {key[:12]} was damaged (") for n in again.notes), again.notes
    assert f"KV of {good.meta.num_tokens} tokens computed and stored now" in again.notes
    assert pipeline.store.kv.get(key).meta.num_tokens == good.meta.num_tokens
    third = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    assert not any("not stored" in n for n in third.notes) and third.token_ids == first.token_ids


@pytest.mark.parametrize("damage", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"], ids=["empty", "header"])
def test_an_entry_file_that_does_not_open_is_told_damaged_not_missing(pipeline, damage):
    """An entry file emptied or with a damaged header: dropped and recomputed like one failing a
    layer's checksum, and the notes say so (they said its KV "was not stored")."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    key = _first_chunk_key(pipeline, first)
    for tier in pipeline.store.kv.tiers:  # the next read comes from disk
        if not tier.persistent:
            tier.delete(key)
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    disk.path_of(key).write_bytes(damage)
    again = pipeline.ask(QUESTION, mode="reuse", top_k=1, params=params)
    assert again.token_ids == first.token_ids
    damaged = [n for n in again.notes if "was damaged" in n]
    assert len(damaged) == 1 and damaged[0].startswith(f"KV entry {key[:12]} was damaged (disk: ")
    assert damaged[0].endswith("recomputed, not served") and not any("not stored" in n for n in again.notes)
    assert disk.get(key) is not None  # stored again, whole


def test_kv_files_removed_behind_the_store_are_stored_again(pipeline):
    """Chunk KV files removed while a pipeline runs (a cleaner, a user): the question recomputes
    them and stores them again, so the next one loads them (the manifest kept listing the gone
    files, and nothing recomputed ever reached the disk)."""
    from ragfuse.engine import SamplingParams

    params = SamplingParams(max_tokens=8)
    first = pipeline.ask(QUESTION, mode="reuse", top_k=2, params=params)
    disk = next(t for t in pipeline.store.kv.tiers if isinstance(t, DiskTier))
    keys = [pipeline.store.docs.chunks([h["id"]])[h["id"]].kv_key for h in first.sources]
    for key in keys:
        for tier in pipeline.store.kv.tiers:
            if not tier.persistent:
                tier.delete(key)
        disk.path_of(key).unlink()
    again = pipeline.ask(QUESTION, mode="reuse", top_k=2, params=params)
    assert again.token_ids == first.token_ids
    assert all(disk.path_of(key).exists() for key in keys)
    for key in keys:
        for tier in pipeline.store.kv.tiers:
            if not tier.persistent:
                tier.delete(key)
    third = pipeline.ask(QUESTION, mode="reuse", top_k=2, params=params)
    assert not any("not stored" in n for n in third.notes) and "disk" in third.tiers


def test_given_passages_are_prefilled_with_a_note_when_redis_is_gone(store, engine):
    """Answering over the caller's passages with the Redis tier gone: the KV lookup fails, the
    passage is prefilled and the notes say why (the KVStoreError failed the request, though
    retrieved chunks were recomputed in the same case)."""
    from ragfuse.app import open_pipeline
    from ragfuse.engine import SamplingParams
    from ragfuse.passage import Passage
    from ragfuse.pipeline import final
    from tests.kvstore_helpers import start_redis

    proc, url = start_redis()
    pipe = open_pipeline(str(store), engine=engine, gate=False, redis_url=url)
    proc.terminate()
    proc.wait(timeout=10)
    text = "The Hollowpoint lighthouse was electrified in 1952 after years of oil lamps."
    try:
        result = final(pipe.stream_passages(QUESTION, [Passage(text=text)], mode="fuse", ratio=0.15,
                                            params=SamplingParams(max_tokens=8)))
    finally:
        pipe.store.close()
    assert result.answer.startswith("The Hollowpoint lighthouse was electrified")
    assert result.sources[0]["stored"] is False
    assert any("could not be read" in n and "Redis" in n for n in result.notes)


def test_cli_ask_json_compares_fuse_with_full(store, tmp_path, monkeypatch, capsys):
    from ragfuse.cli import main  # the command's entry point in this process (test_cli runs the executable)
    from ragfuse.engine.checkpoint import cache_root

    # a cache without the accuracy gate's calibrations (the converted model shared): a chosen ratio
    # needs no r*, so the command must not spend minutes calibrating one
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(models)
    monkeypatch.setenv("RAGFUSE_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["ask", QUESTION, "--store", str(store), "--json", "--compare", "--top-k", "2",
                 "--recompute-ratio", "0.3", "--max-tokens", "16"]) == 0
    assert not (tmp_path / "cache" / "gate").exists()
    out = json.loads(capsys.readouterr().out)
    for key in ("answer", "sources", "mode", "recompute_ratio", "ttft_s", "total_s", "prompt_tokens",
                "reused_tokens", "recomputed_tokens", "load_s", "recompute_s", "tiers"):
        assert key in out
    assert out["mode"] == "fuse" and out["compare"]["full"]["mode"] == "full"
    assert {"id", "text", "source", "score"} <= set(out["sources"][0])
    # as text: full prefill's answer is printed where it differs (the line said only "answers differ")
    assert main(["ask", QUESTION, "--store", str(store), "--compare", "--top-k", "2", "--mode", "reuse",
                 "--recompute-ratio", "0.3", "--max-tokens", "16"]) == 0
    text = capsys.readouterr().out
    assert "full prefill: TTFT" in text
    assert ("full prefill's answer: " in text) == ("answers differ" in text)


def test_cli_ask_refuses_bad_input(store, tmp_path):
    for args, needle in [
        (["ask", QUESTION, "--store", str(tmp_path / "none")], "no ragfuse store"),
        (["ask", "  ", "--store", str(store)], "empty"),
        (["ask", QUESTION, "--store", str(store), "--recompute-ratio", "2"], "ratio"),
        (["ask", QUESTION, "--store", str(store), "--mode", "magic"], "invalid choice"),
    ]:
        r = subprocess.run([sys.executable, "-m", "ragfuse.cli", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("mode", ["reuse", "fuse"])
def test_kv_computed_for_the_question_is_not_counted_reused(pipeline, mode):
    """A chunk missing from the store is computed (and stored) for the question that needs it; the pass
    then loads that KV like stored KV, and counted it reused: a cold store reported every chunk a hit."""
    two = SamplingParams(max_tokens=2)
    warm = pipeline.ask(QUESTION, mode=mode, ratio=0.2, top_k=1, params=two)
    chunk = next(s for s in pipeline.prepare(QUESTION, 1, mode, 0.2)[0].segments if s.label.startswith("chunk"))
    chunk.kv.finish()
    assert pipeline.store.kv.delete(pipeline.chunk_kv.key(chunk.token_ids))
    cold = pipeline.ask(QUESTION, mode=mode, ratio=0.2, top_k=1, params=two)
    assert any("computed and stored now" in n for n in cold.notes) and "computed" in cold.tiers
    # all that is reused now is the instruction prefix, served by relay (registered by the warm question)
    assert cold.reused_tokens == cold.relay_system_tokens > 0 and warm.reused_tokens > cold.reused_tokens


def test_a_slow_tier_loads_the_first_pieces_and_computes_the_other_chunks(pipeline, engine, tmp_path):
    """A profile whose tiers load all the stored KV in 90% of a full prefill's time: the controller
    loads the first pieces only (the instruction and some chunks), the pipeline releases the others'
    stored KV unread and computes them in full, and the answer counts them recomputed."""
    from ragfuse.controller_source import ControllerSource
    from ragfuse.engine.kvstore import DelayProfile, LoadingController
    from ragfuse.pipeline import RagPipeline

    per_token = engine.model_config.kv_bytes_per_token(engine.dtype)
    profile = DelayProfile(model="m", device="cpu", dtype="float32", kv_bytes_per_token=per_token,
                           prefill_points=[(1000, 1.0)], recompute_points=[(1000, 0.0, 0.1), (1000, 1.0, 1.0)],
                           bandwidth={t: per_token / 0.9e-3 for t in ("gpu", "cpu", "disk", "redis")})
    controlled = RagPipeline(engine, pipeline.store, r_star=0.15, controller=ControllerSource(
        tmp_path / "profile.json", lambda: (LoadingController(profile, r_star=0.15), None)))
    params = SamplingParams(max_tokens=8)
    controlled.ask(QUESTION, mode="reuse", top_k=3, params=params)  # the instruction's relay prompt registered
    result = controlled.ask(QUESTION, mode="fuse", top_k=3, params=params)
    chunks = pipeline.store.docs.chunks([s["id"] for s in result.sources])
    chunk_tokens = sum(len(c.token_ids) for c in chunks.values())
    decision = result.decision
    assert decision is not None and decision["loaded_sources"] in (2, 3), decision  # of the instruction + 3 chunks
    assert decision["ttft_estimate_s"] < 0.9 * decision["t_prefill_s"]  # sooner than loading all, or none
    assert any(f"loaded the first {decision['loaded_sources']} of 4 stored pieces" in n for n in result.notes)
    assert result.recomputed_tokens + result.reused_tokens - result.relay_system_tokens == chunk_tokens
    assert result.recompute_ratio == pytest.approx(result.recomputed_tokens / chunk_tokens)
    # at the loaded chunks' ratio alone the share would be that ratio: the computed chunks come on top
    assert result.recompute_ratio > decision["recompute_ratio"] + 0.1, (result.recompute_ratio, decision)
    assert result.answer
