"""The delay profile of a random-weight shape on a GPU, and the controller's estimates checked.

``ragfuse profile`` needs real weights and an ingested store; a GPU machine without the default
model's GGUF reader has neither. This measures the same profile (``measure_profile``) for a shape,
then for each tier runs the fused pass the controller chooses, full reuse and r*, and sets each TTFT beside
the controller's estimate of it.

Usage: python3 scripts/profile_shape.py OUT.json [--shape mistral-7b] [--context 3072]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from ragfuse.bench.fusion import _engine
from ragfuse.commands.profile import QUERY_TOKENS, build_tiers, measure_profile, profile_prompt
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import LoadingController


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--context", type=int, default=3072)
    p.add_argument("--chunk-tokens", type=int, default=512)
    a = p.parse_args()
    eng = _engine(argparse.Namespace(chunks=a.context // a.chunk_tokens + 1, chunk_tokens=a.chunk_tokens,
                                     query_tokens=QUERY_TOKENS, device="cuda", model=None), a.shape)
    with tempfile.TemporaryDirectory() as tmp:
        prof = measure_profile(eng, [512, 1024, 2048, 4096], a.context, a.chunk_tokens, 6, Path(tmp) / "bw")
        controller = LoadingController(prof)
        prompt = profile_prompt(eng, a.context, a.chunk_tokens)
        checks = []
        for tier in build_tiers(eng.device, prompt.kv_bytes, 1, Path(tmp) / "kv", None):
            prompt.keep_in(tier)
            decision = controller.decide(a.context, tier.name)
            t_load = controller.t_load(a.context, tier.name)
            # the controller's pass, and full reuse and r* beside it: their TTFT is the load's where it is
            # the longer part, so they check the tier's load estimate too, not only the recompute curve
            for ratio in sorted({0.0, controller.r_star, decision.recompute_ratio}):
                policy = SelectionPolicy.default().with_ratio(ratio)
                mode = "fuse" if ratio > 0 else "reuse"
                prompt.run(tier.name, mode, policy)  # warm-up: graphs for this ratio's sizes
                st = prompt.median(tier.name, mode, policy, 5)
                t_rec = controller.t_recompute(ratio, a.context)
                checks.append({"tier": tier.name, "ratio": ratio, "chosen": ratio == decision.recompute_ratio,
                               "reason": decision.reason, "t_load_estimate_s": t_load,
                               "ttft_estimate_s": t_rec if ratio >= 1 else max(t_rec, t_load), "ttft_s": st.total_s,
                               "load_s": st.load_s, "compute_s": st.compute_s})
                print(checks[-1], flush=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": a.shape,
                                       "profile": prof.__dict__, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
