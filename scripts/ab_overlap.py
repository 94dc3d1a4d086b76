"""Overlapped decode on and off in one engine (`EngineConfig.overlap_decode` toggled), the prefix-shared
and relay paths, interleaved rounds: the A/B behind results/relay-h100-1126c/overlap.

Run on a CUDA machine: ``python scripts/ab_overlap.py OUT.json SHAREGPT.jsonl [--shape mistral-7b]
[--requests 64] [--rounds 3]``. Random weights of the shape in bf16, a 2048-token system prompt, ShareGPT
first-turn lengths, up to 64 requests at once (with more requests, each is admitted as another ends).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ragfuse.bench.relay import ab_setup

SYSTEM = 2048


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("data")
    p.add_argument("--shape", default="mistral-7b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    run = ab_setup(a.shape, torch.device("cuda"), SYSTEM, a.requests, a.data)
    rows = []
    for r in range(a.rounds):
        for overlap in (False, True):
            run.eng.config.overlap_decode = overlap
            for mode in ("shared", "relay"):
                ahead = run.eng.runner.steps_ahead
                secs, tokens = run.time(mode)
                rows.append({"round": r, "overlap": overlap, "mode": mode, "secs": secs, "tok": tokens,
                             "ahead": run.eng.runner.steps_ahead - ahead})
                print(rows[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    for overlap in (False, True):
        med = {mode: statistics.median(x["secs"] for x in rows if x["overlap"] == overlap and x["mode"] == mode)
               for mode in ("shared", "relay")}
        print(f"{a.shape} requests={a.requests} overlap={overlap}: shared {med['shared']:.4f} s, "
              f"relay {med['relay']:.4f} s, relay/shared {med['shared'] / med['relay']:.3f}")


if __name__ == "__main__":
    main()
