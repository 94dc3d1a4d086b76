"""fuse@15% on the CPU with and without the mass cap, default model, 6 x 512 + 32 random tokens, CPU tier,
interleaved, medians of 7 after one warm-up each."""
import json
import statistics
from dataclasses import replace

from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import MemoryTier

eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", device="cpu", max_model_len=4096))
chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
prompt = StoredPrompt(eng, chunks, query)
prompt.keep_in(MemoryTier("cpu", "cpu", prompt.kv_bytes * 2))
on = SelectionPolicy.default()
off = replace(on, k_mass_cap=0.0)
prompt.run("cpu", "fuse", on), prompt.run("cpu", "fuse", off)
t = {"cap": [], "nocap": []}
for _ in range(7):
    t["cap"].append(prompt.run("cpu", "fuse", on).total_s)
    t["nocap"].append(prompt.run("cpu", "fuse", off).total_s)
full = statistics.median(prompt.run("cpu", "full", on).total_s for _ in range(3))
med = {k: statistics.median(v) for k, v in t.items()}
print(json.dumps({"median_s": med, "ratio": med["cap"] / med["nocap"], "full_s": full,
                  "full_over_fuse": {k: full / v for k, v in med.items()},
                  "runs_s": {k: [round(x, 3) for x in v] for k, v in t.items()}}))
