"""RAG queries served at once in a KV cache too small for them all: the engine preempts fused requests
and swaps their KV to host memory; every answer is the one the same query gets alone, the metrics
count the swaps and show the cache's use, and nothing is left held (cache blocks, host copies)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from tests.server_helpers import KEY, MODEL, serve_lighthouses

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["When was the Hollowpoint lighthouse electrified?", "How tall is the Hollowpoint tower?",
             "Who was the last keeper of Hollowpoint?", "Why was Grey Skerry light built?",
             "How does Grey Skerry flash?", "How far can the Hollowpoint light be seen?",
             "What happened to the steamer Aldan?", "What fuel did the Hollowpoint lamp burn over the years?"]
# blocks of 16 tokens: the relay instruction's 2 and room for two of these RAG prompts (~217 tokens of
# their own, 14 blocks each) with no block to spare, so two answering at once preempt one of them
CACHE_BLOCKS = 30


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    from ragfuse.engine import LLM, EngineConfig, LLMEngine, ModelConfig
    from ragfuse.engine import checkpoint as ckpt

    mc = ModelConfig.from_dir(ckpt.resolve(MODEL).path)
    per_block = mc.kv_bytes_per_token(torch.float32) * 16
    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_bytes=CACHE_BLOCKS * per_block))
    with serve_lighthouses(tmp_path_factory.mktemp("store"), LLM.from_engine(engine)) as srv:
        yield srv


def ask(url: str, question: str) -> dict:
    r = httpx.post(f"{url}/v1/rag/query", json={"question": question, "top_k": 2, "max_tokens": 64},
                   headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def preemptions(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    prefix = "ragfuse_preemptions_total{kind=\""
    return {line[len(prefix):].split('"')[0]: float(line.rpartition(" ")[2])
            for line in text.splitlines() if line.startswith(prefix)}


def gauges(url: str) -> dict[str, float]:
    """The KV cache's gauges: blocks in use (share) and swapped bytes."""
    lines = httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines()
    return {name: float(line.rpartition(" ")[2]) for line in lines
            for name in ("ragfuse_kv_cache_usage_ratio", "ragfuse_swap_space_bytes") if line.startswith(name + " ")}


def test_concurrent_rag_answers_survive_preemption_unchanged(tight):
    alone = [ask(tight.url, q) for q in QUESTIONS]
    assert preemptions(tight.url) == {"swapped": 0.0, "recomputed": 0.0}
    together: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(tight.url, QUESTIONS[i])))
               for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    seen = []  # the gauges while they answer
    while any(t.is_alive() for t in threads):
        seen.append(gauges(tight.url))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert [together[i]["answer"] for i in range(len(QUESTIONS))] == [a["answer"] for a in alone]
    counts = preemptions(tight.url)
    assert counts["swapped"] >= 1 and counts["recomputed"] == 0, counts
    engine = tight.engine
    assert engine.scheduler.swap.used_bytes == 0 and not engine.scheduler.has_work
    relay_held = sum(len(engine.systems.get(sid).block_table) for sid in engine.relay_prompts._used)
    assert engine.blocks.num_free == engine.blocks.num_blocks - relay_held
    # under that load the cache filled up and swapped KV sat in host memory; after it, only the relay
    # instruction's blocks are held and no swapped KV is left
    assert max(g["ragfuse_kv_cache_usage_ratio"] for g in seen) > 0.9
    assert max(g["ragfuse_swap_space_bytes"] for g in seen) > 0
    assert gauges(tight.url) == {"ragfuse_kv_cache_usage_ratio": relay_held / CACHE_BLOCKS,
                                 "ragfuse_swap_space_bytes": 0.0}
