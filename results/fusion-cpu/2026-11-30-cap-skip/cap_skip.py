"""The reference mass cap's skip (``may_bind``), default model, CPU: how many layers and segments its bound clears in
a fuse@15% pass over `bench fusion`'s prompt (6 x 512 + 32 random tokens); then on four MuSiQue dev cases (their 10
passages stored as chunks, the question after them) fuse@15% with the skip, with every segment walked, and without
the cap, interleaved, medians of 3, and what the bound cleared there.
Usage: OMP_NUM_THREADS=2 python results/fusion-cpu/2026-11-30-cap-skip/cap_skip.py"""
import json
import statistics
from dataclasses import replace

import torch

from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import MemoryTier
from ragfuse.kernels import mass_direction as md

shipped = md.may_bind
stats: dict[str, int] = {}


def counting(mk, q, ok, limit, scale):
    walk = shipped(mk, q, ok, limit, scale)
    real = (mk.norm(dim=-1) > 0).any(dim=1)  # segments with a shift (not the spare)
    for key, n in (("layers", 1), ("layers_cleared", int(not bool(walk.any()))), ("segments", int(real.sum())),
                   ("segments_walked", int((walk & real).sum()))):
        stats[key] = stats.get(key, 0) + n
    return walk


def walk_all(mk, q, ok, limit, scale):
    return torch.ones(mk.shape[0], dtype=torch.bool)


eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", device="cpu", max_model_len=8192))
tok = eng.tokenizer
with open("../shared/data/musique_dev.json") as f:
    data = json.load(f)
on = SelectionPolicy.default()
off = replace(on, k_mass_cap=0.0)
md.may_bind = counting
chunks, query = random_prompt(eng.model_config.vocab_size, 6, 512, 32)
bench_prompt = StoredPrompt(eng, chunks, query)
bench_prompt.keep_in(MemoryTier("cpu", "cpu", bench_prompt.kv_bytes * 2))
bench_prompt.run("cpu", "fuse", on)
print(json.dumps({"bench_prompt": stats}), flush=True)
stats.clear()
for case in data[:4]:
    chunks = [tok.encode(f"{c['title']}\n{c['text']}\n", add_special_tokens=False) for c in case["ctxs"]]
    query = tok.encode(f"Question: {case['question']}\nAnswer:", add_special_tokens=False)
    prompt = StoredPrompt(eng, chunks, query)
    prompt.keep_in(MemoryTier("cpu", "cpu", prompt.kv_bytes * 2))
    md.may_bind = counting
    prompt.run("cpu", "fuse", on)
    t = {"skip": [], "walk_all": [], "no_cap": []}
    for _ in range(3):
        md.may_bind = shipped
        t["skip"].append(prompt.run("cpu", "fuse", on).total_s)
        md.may_bind = walk_all
        t["walk_all"].append(prompt.run("cpu", "fuse", on).total_s)
        md.may_bind = shipped
        t["no_cap"].append(prompt.run("cpu", "fuse", off).total_s)
    row = {k: round(statistics.median(v), 3) for k, v in t.items()}
    print(json.dumps(row | {"tokens": sum(map(len, chunks)) + len(query)}), flush=True)
print(json.dumps({"musique": stats}))
