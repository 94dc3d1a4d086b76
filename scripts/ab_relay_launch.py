"""Relay decode launch variants end to end: one process per variant (each captures its own decode
graphs), the prefix-shared and relay paths in interleaved rounds: the A/B behind
results/relay-h100-1126d/ab-system-shares.

Run on a CUDA machine, once per variant: ``python scripts/ab_relay_launch.py OUT.json SHAREGPT.jsonl
VARIANT [--rounds 3]``. Random-weight Mistral-7B in bf16, a 2048-token system prompt, 64 requests of
ShareGPT first-turn lengths at once. A variant sets ``RelayTuning`` fields or the split-rule constants
of ``kernels/relay_triton.py`` before the engine registers the system prompt (which captures the relay
graphs); ``VARIANTS`` lists them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from ragfuse.bench.relay import ab_setup
from ragfuse.kernels import relay_triton

SYSTEM = 2048
VARIANTS: dict[str, tuple[dict[str, object], dict[str, object]]] = {  # name: (tuning fields, module constants)
    "default": ({}, {}),
    "ctx32": ({"ctx_block_n": 32}, {}),
    "ctx128": ({"ctx_block_n": 128}, {}),
    "sys32": ({"sys_block_n": 32}, {}),
    "half": ({"half_partials": True}, {}),
    "minsplit2": ({}, {"RELAY_MIN_CONTEXT_SPLITS": 2}),
    "minsplit4": ({}, {"RELAY_MIN_CONTEXT_SPLITS": 4}),
    # both parts' programs per multiprocessor, as the A/B of 2026-11-26 set them (the context rule's
    # minimum of 3 splits decides at 8 or more sequences either way)
    "per_sm0.25": ({}, {"RELAY_PROGRAMS_PER_SM": 0.25, "RELAY_SYSTEM_PROGRAMS_PER_SM": 0.25}),
    "per_sm0.5": ({}, {"RELAY_PROGRAMS_PER_SM": 0.5, "RELAY_SYSTEM_PROGRAMS_PER_SM": 0.5}),
    "per_sm0.75": ({}, {"RELAY_PROGRAMS_PER_SM": 0.75, "RELAY_SYSTEM_PROGRAMS_PER_SM": 0.75}),
    "per_sm1": ({}, {"RELAY_PROGRAMS_PER_SM": 1.0, "RELAY_SYSTEM_PROGRAMS_PER_SM": 1.0}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("data")
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tuning, constants = VARIANTS[a.variant]
    relay_triton.DEFAULT_TUNING = replace(relay_triton.DEFAULT_TUNING, **tuning)
    for name, value in constants.items():
        setattr(relay_triton, name, value)
    run = ab_setup("mistral-7b", torch.device("cuda"), SYSTEM, 64, a.data)
    rows = []
    for r in range(a.rounds):
        for mode in ("shared", "relay"):
            secs, tokens = run.time(mode)
            rows.append({"round": r, "variant": a.variant, "mode": mode, "secs": secs, "tok": tokens})
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    med = {mode: statistics.median(x["secs"] for x in rows if x["mode"] == mode) for mode in ("shared", "relay")}
    print(f"{a.variant:12} shared {med['shared']:.4f} s, relay {med['relay']:.4f} s, "
          f"relay/shared {med['shared'] / med['relay']:.4f}", flush=True)


if __name__ == "__main__":
    main()
