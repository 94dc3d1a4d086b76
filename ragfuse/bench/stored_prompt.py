"""A random RAG prompt whose chunks' KV lies in KV tiers, and timed fused passes over it.

What ``ragfuse bench fusion`` and ``ragfuse profile`` both time: the same prompt shape (stored chunks,
then a computed query) run through the engine's fused prefill in any mode and at any ratio, so the
delay profile's recompute curve and the benchmark's rows measure the same thing.
"""

from __future__ import annotations

from typing import Any

import torch


def random_prompt(vocab: int, chunks: int, chunk_tokens: int, query_tokens: int) -> tuple[list[list[int]], list[int]]:
    """``chunks`` random chunks and a random query (fixed seed, ids from 3 up so no special token
    lands in them). Random ids time the same as text for a random-weight model, and the profile
    scripts use this too, so their passes match the bench's."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (chunk_tokens,), generator=gen).tolist() for _ in range(chunks)]
    return ids, torch.randint(3, vocab, (query_tokens,), generator=gen).tolist()


class StoredPrompt:
    """``chunks`` followed by ``query``; the chunks' KV is computed once and kept in each tier given
    to ``keep_in``."""

    def __init__(self, engine: Any, chunks: list[list[int]], query: list[int]) -> None:
        from ragfuse.engine.kvstore import StoredKV, kv_key

        self.engine, self.chunks, self.query = engine, chunks, query
        self.keys = [kv_key(engine.fingerprint, engine.dtype, c) for c in chunks]
        kvs = engine.compute_kv(chunks)
        self.entries = [StoredKV.from_kv(k, kk, vv) for k, (kk, vv) in zip(self.keys, kvs, strict=True)]
        del kvs
        self.kv_bytes = sum(e.nbytes for e in self.entries)
        self.stores: dict[str, Any] = {}

    def keep_in(self, tier: Any) -> None:
        """Put the chunks' KV in ``tier`` (at least ``kv_bytes`` big); passes may then load from it."""
        from ragfuse.engine.kvstore import TieredKVStore

        for e in self.entries:
            tier.put(e, keep_evicted=False)
        self.stores[tier.name] = TieredKVStore([tier])

    def run(self, tier: str, mode: str, policy: Any, loaded: int | None = None) -> Any:
        """One fused prefill from ``tier`` (its page cache dropped first, so a disk is really read);
        returns its ``FusionStats``. ``loaded``: only the first chunks bring their stored KV, the others
        are computed (a loading controller's partial load); None: all of them."""
        from ragfuse.engine.fusion import Segment
        from ragfuse.engine.kvstore import open_source

        store = self.stores[tier]
        for k in self.keys:
            store.tiers[0].drop_cache(k)
        n = len(self.chunks) if loaded is None else loaded
        segs = [Segment(c, open_source(store, k) if mode != "full" and i < n else None)
                for i, (c, k) in enumerate(zip(self.chunks, self.keys, strict=True))]
        segs.append(Segment(self.query))
        with self.engine.borrowed_blocks([[t for s in segs for t in s.token_ids]]) as (table,):
            _logits, stats = self.engine.runner.fused_prefill(table, segs, mode, policy)
        return stats

    def median(self, tier: str, mode: str, policy: Any, repeats: int, loaded: int | None = None) -> Any:
        """The stats of the median pass (by TTFT) of ``repeats`` (``loaded``: as in ``run``)."""
        runs = sorted((self.run(tier, mode, policy, loaded) for _ in range(repeats)), key=lambda s: s.total_s)
        return runs[len(runs) // 2]

    def recompute_curve(self, tier: str, ratios: list[float], repeats: int, progress: Any = None,
                        ) -> list[tuple[float, float]]:
        """(ratio, compute time of a fused pass at that ratio / a full pass's), each point's first
        pass untimed (kernels compile, CUDA graphs are captured per active-set size) and the fastest of
        ``repeats`` kept: on a shared machine other work only adds time, and a median of two let one
        slow full pass flatten the whole curve. Ratio 0 is full KV reuse; ``progress`` (a tqdm) is
        advanced once a point."""
        from ragfuse.engine.fusion import SelectionPolicy

        policy = SelectionPolicy.default()

        def seconds(mode: str, ratio: float) -> float:
            self.run(tier, mode, policy.with_ratio(ratio))
            times = [self.run(tier, mode, policy.with_ratio(ratio)).compute_s for _ in range(repeats)]
            if progress is not None:
                progress.update()
            return min(times)

        full = seconds("full", 0.0)
        return [(r, seconds("fuse" if r > 0 else "reuse", r) / full) for r in ratios]
