"""Overlapped decode on/off, one engine, interleaved: Mistral-7B shape, 2K system, 64 ShareGPT requests."""
import json, sys, time
import torch
from ragfuse.bench.relay import run_mode, workload
from ragfuse.bench.shapes import shape_config
from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

out, data = sys.argv[1], sys.argv[2]
shape = sys.argv[3] if len(sys.argv) > 3 else "mistral-7b"
nreq = int(sys.argv[4]) if len(sys.argv) > 4 else 64
cfg = shape_config(shape); need = 2048 + 512 + 128 + 16
cfg["max_position_embeddings"] = max(min(cfg["max_position_embeddings"], 32768), need)
eng = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=need, prefix_tree=False),
                random_weights=ModelConfig.from_dict(cfg))
sync = torch.cuda.synchronize
g = torch.Generator().manual_seed(0)
lens = workload(data, nreq, 512, 128)
reqs = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n, _ in lens]
outs = [o for _, o in lens]
system = torch.randint(3, cfg["vocab_size"], (2048,), generator=g).tolist()
sid = eng.register_system(system)
for mode in ("shared", "relay"):
    run_mode(eng, mode, system, sid, reqs, [2] * len(reqs), sync)
rows = []
for r in range(3):
    for ov in (False, True):
        eng.config.overlap_decode = ov
        for mode in ("shared", "relay"):
            a = eng.runner.steps_ahead
            secs, tok = run_mode(eng, mode, system, sid, reqs, outs, sync)
            rows.append(dict(round=r, overlap=ov, mode=mode, secs=secs, tok=tok, ahead=eng.runner.steps_ahead - a))
            print(rows[-1], flush=True)
json.dump(rows, open(out, "w"), indent=1)
import statistics as st
for ov in (False, True):
    m = {mode: st.median(x["secs"] for x in rows if x["overlap"] == ov and x["mode"] == mode) for mode in ("shared", "relay")}
    print(f"RESULT {shape} n={nreq} overlap={ov}: shared {m['shared']:.4f} relay {m['relay']:.4f} ratio {m['shared']/m['relay']:.3f}")
