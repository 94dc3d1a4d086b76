"""Small real KV entries for the store tests (random values of a tiny model shape)."""

from __future__ import annotations

import torch

from ragfuse.engine.kvstore import StoredKV, kv_key

LAYERS, HEADS, DIM = 4, 2, 16


def make_entry(seed: int, tokens: int = 32, dtype: torch.dtype = torch.float32) -> StoredKV:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, tokens, HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(LAYERS, tokens, HEADS, DIM, generator=gen).to(dtype)
    return StoredKV.from_kv(kv_key("test-model", dtype, [seed, tokens]), k, v)


def same(a: StoredKV, b: StoredKV) -> bool:
    ka, va = a.kv()
    kb, vb = b.kv()
    return a.key == b.key and torch.equal(ka.cpu(), kb.cpu()) and torch.equal(va.cpu(), vb.cpu())
