"""Loading only the first k chunks from the disk tier and recomputing the others in full: TTFT per k.

The measurement behind the loading controller's partial loads (built after it: results/fusion-h200-1201e/):
``ragfuse bench fusion``'s prompt (6 x 512 random tokens + 32, random-weight bf16 model on CUDA), the chunks' KV in
a disk tier whose page cache is dropped before every pass. For k = 0 the pass is full prefill; for k >= 1 the
first k chunks bring their stored KV (fuse at 15%: the first chunk is an exact prefix, the next k - 1 are fused)
and the other chunks run as tokens without stored KV (always computed, so exact given what precedes them).

Usage: python3 partial_load.py OUT.json [--shapes mistral-7b,yi-34b] [--repeats 3] [--order 0,1,2,3,4,5,6]
(``--order``: the values of k in the order run, repeats allowed, so a disk that slows as it is read shows)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ragfuse.bench.fusion import _engine
from ragfuse.bench.stored_prompt import StoredPrompt, random_prompt
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.engine.kvstore import DiskTier

CHUNKS, CHUNK_TOKENS, QUERY_TOKENS = 6, 512, 32


def ttft(prompt: StoredPrompt, loaded: int, policy: SelectionPolicy) -> tuple[float, float, float]:
    """(TTFT, load, wait) in ms of one pass loading the first ``loaded`` chunks from disk."""
    stats = prompt.run("disk", "fuse" if loaded else "full", policy, loaded)
    return stats.total_s * 1e3, stats.load_s * 1e3, stats.load_wait_s * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shapes", default="mistral-7b,yi-34b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--order", default=",".join(str(k) for k in range(CHUNKS + 1)))
    a = p.parse_args()
    policy = SelectionPolicy.default().with_ratio(0.15)
    out: dict[str, list[dict[str, float]]] = {}
    for shape in a.shapes.split(","):
        eng = _engine(argparse.Namespace(chunks=CHUNKS, chunk_tokens=CHUNK_TOKENS, query_tokens=QUERY_TOKENS,
                                         device="cuda", model=None), shape)
        chunks, query = random_prompt(eng.model_config.vocab_size, CHUNKS, CHUNK_TOKENS, QUERY_TOKENS)
        prompt = StoredPrompt(eng, chunks, query)
        with tempfile.TemporaryDirectory() as tmp:
            prompt.keep_in(DiskTier(Path(tmp) / "kv", prompt.kv_bytes * 2, reserve_bytes=0))
            for loaded in (int(k) for k in a.order.split(",")):
                ttft(prompt, loaded, policy)  # warm-up: kernels, graphs of this active-set size
                runs = sorted(ttft(prompt, loaded, policy) for _ in range(a.repeats))
                t, load, wait = runs[len(runs) // 2]
                out.setdefault(shape, []).append({"loaded": loaded, "ttft_ms": t, "load_ms": load, "wait_ms": wait,
                                                  "ttfts_ms": [r[0] for r in runs]})
                print(f"{shape} loaded {loaded}: ttft {t:.1f} ms (load {load:.1f}, wait {wait:.1f}; "
                      f"all {[round(r[0], 1) for r in runs]})", flush=True)
        del prompt, eng
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
