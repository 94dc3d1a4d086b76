"""Sessions on CUDA (random weights, float32): the side-stream snapshot stores K without position
exactly as ``compute_kv`` computes it, and a restored turn answers as recomputing the history (from
host memory: its new tokens replayed one prefill graph per layer, the history written in between,
copied at the turn, all ahead of it, or its first layers ahead: the read buffer)."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ragfuse.engine.sessions import SessionStore

pytestmark = pytest.mark.gpu

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "eos_token_id": 0,
}


@pytest.mark.parametrize("where", ["cpu", "read-buffer", "preloaded", "disk"])
def test_cuda_session_turn_matches_recompute(tmp_path, where: str) -> None:
    eng = LLMEngine(EngineConfig(device="cuda", dtype="float32", kv_cache_bytes=64 << 20),
                    random_weights=ModelConfig.from_dict(SHAPE))
    store = SessionStore(tmp_path, eng.fingerprint, eng.dtype, cpu_bytes=0 if where == "disk" else 1 << 30)
    eng.enable_sessions(store)
    g = torch.Generator().manual_seed(0)
    history = torch.randint(1, 1000, (300,), generator=g).tolist()
    new = torch.randint(1, 1000, (20,), generator=g).tolist()
    sp = SamplingParams(max_tokens=6, ignore_eos=True)

    def finish(rid: str):
        while True:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out

    first = finish(eng.add_session_request("g", history, sp))
    eng.close_turns()  # the answer's last token computed, then the session saved
    store.flush()
    rec = store._records["g"]
    assert rec.num_rows == len(history) + sp.max_tokens
    (k_ref, v_ref), = eng.compute_kv([rec.tokens[: rec.num_rows]])
    entry = store._memory.get("g") or store.disk.get(rec.key)
    k, v = entry.kv()
    torch.testing.assert_close(k, k_ref.cpu(), atol=2e-4, rtol=1e-4)  # un-rotated K = K before RoPE
    torch.testing.assert_close(v, v_ref.cpu(), atol=2e-4, rtol=1e-4)
    conversation = history + first.token_ids + new
    graphs = eng.runner.prefill_graphs
    counts = (graphs.replays, graphs.layer_replays) if graphs is not None else (0, 0)
    turn = eng.begin_session_turn("g", conversation, sp.max_tokens)
    if where == "read-buffer":  # the history copied to the GPU before the turn starts (while a previous job ran)
        eng.preload_session_turn(turn)
        torch.cuda.synchronize()
    elif where == "preloaded":  # a read buffer of the first layers; the turn copies the rest as it runs
        eng.preload_session_turn(turn, 2)
        eng.preload_session_turn(turn, 1)  # a smaller request later copies nothing twice
        assert turn.source.staged
    out = finish(eng.start_session_turn(turn, sp))
    assert out.metrics["session_tier"] == ("disk" if where == "disk" else "cpu")
    assert out.metrics["session_tokens_reused"] == rec.num_rows
    if where != "disk" and graphs is not None:  # each layer's history written between the layers' graphs
        assert (graphs.replays, graphs.layer_replays) == (counts[0], counts[1] + 1)
    assert out.token_ids == finish(eng.add_request(conversation, sp)).token_ids
    store.close()
