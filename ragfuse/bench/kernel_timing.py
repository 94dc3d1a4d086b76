"""Times the Triton kernels on the GPU against torch's own kernels and against the two floors.

Run on the GPU machine: ``python -m ragfuse.bench.kernel_timing [out.json] [--turn | --pack | --scattered]``
(``--turn``: only the session-turn cases; ``--pack``: grouped-query packing against one head per
tile; ``--scattered``: tilings of cache fusion's attention). Shapes are Mistral-7B's attention
(32 query heads, 8 KV heads, head_dim 128) in bf16. It first measures the two ceilings
(device-to-device copy bandwidth, bf16 matmul rate), then for each case prints the kernel's time, the
flops floor and the bytes floor; kernels/NOTES.md records the results.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

from ragfuse.kernels import paged_attention_triton as pat
from ragfuse.kernels.norm import fused_add_rms_norm_ref
from ragfuse.kernels.norm_triton import fused_add_rms_norm_triton
from ragfuse.kernels.rope import apply_rope_ref, cos_sin_table, inv_frequencies
from ragfuse.kernels.rope_triton import apply_rope_qk_triton

H, KVH, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
ROWS: list[dict[str, object]] = []


def ms(fn: Callable[[], object]) -> float:
    """Median over replays of a CUDA graph of ``fn``: launch overhead stays out, as in the engine."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def record(case: str, version: str, t_ms: float, flops: float = 0.0, nbytes: float = 0.0) -> None:
    row = {"case": case, "version": version, "ms": round(t_ms, 4)}
    if flops:
        row["tflops"] = round(flops / t_ms / 1e9, 1)
    if nbytes:
        row["gbs"] = round(nbytes / t_ms / 1e6, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def with_tiling(case: str, label: str, tiles: tuple[int, int, int, int], fn: Callable[[], object],
                flops: float, nbytes: float = 0.0) -> None:
    """Time ``fn`` with the prefill kernel held to ``tiles``; a tiling that does not fit shared
    memory is noted and the sweep goes on."""
    default = pat._prefill_tiles
    pat._prefill_tiles = lambda *_, **__: tiles
    try:
        record(case, label, ms(fn), flops, nbytes)
    except Exception as e:
        print(f"{label} failed: {e!r:.200}", flush=True)
    finally:
        pat._prefill_tiles = default


def ceilings() -> tuple[float, float]:
    """(bytes/s of a device copy counting read + write, bf16 matmul flop/s), on random data."""
    src = torch.randn(1 << 29, device="cuda", dtype=DT)  # 1 GiB
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / (ms(lambda: dst.copy_(src)) * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    rate = 2 * 8192**3 / (ms(lambda: a @ b) * 1e-3)
    record("ceiling", "copy GB/s", 0.0, nbytes=0)
    ROWS[-1].update(gbs=round(bw / 1e9, 1))
    record("ceiling", "bf16 matmul TFLOP/s", 0.0)
    ROWS[-1].update(tflops=round(rate / 1e12, 1))
    return bw, rate


def paged(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = [-(-n // PAGE) for n in seq_lens]
    blocks = sum(need)
    k = torch.randn(blocks, PAGE, KVH, D, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    perm = torch.randperm(blocks, device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[at : at + n]
        at += n
    return k, v, tables


def turn_inputs(t: int, ctx: int, rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """One sequence of ``t`` new tokens after ``ctx`` cached ones: paged K/V, block table, ``rows``
    queries (default ``t``; more for a padded graph grid), sequence lengths, query bounds, and the
    attention's causal FLOPs."""
    n = ctx + t
    k_cache, v_cache, tables = paged([n])
    q = torch.randn(rows or t, H, D, device="cuda", dtype=DT)
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, q, lens, cu, 4 * H * D * (t * ctx + t * t / 2)


def prefill(t: int, ctx: int, bw: float, rate: float) -> None:
    """One sequence of ``t`` new tokens after ``ctx`` cached ones."""
    n = ctx + t
    k_cache, v_cache, tables, q, lens, cu, flops = turn_inputs(t, ctx)
    scale = D**-0.5
    nbytes = (2 * t * H * D + 2 * n * KVH * D) * 2
    case = f"prefill t={t} ctx={ctx}"
    print(f"# {case}: floors {flops / rate * 1e3:.3f} ms (flops), {nbytes / bw * 1e3:.4f} ms (bytes)", flush=True)
    fn = functools.partial(pat.paged_prefill_attention_triton, q, k_cache, v_cache, tables, lens, cu, scale, None, t)
    for tiles in [(64, 64, 4, 3), (128, 128, 8, 3)]:
        with_tiling(case, f"triton {tiles}", tiles, fn, flops, nbytes)
    if ctx:
        return
    kk = k_cache.view(-1, KVH, D)[:t]
    vv = v_cache.view(-1, KVH, D)[:t]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ragfuse.engine.attention.layer import cudnn_prefill

    record(case, "cudnn_prefill (engine path, lse)", ms(lambda: cudnn_prefill(q, kk, vv, scale)), flops, nbytes)
    qb, kb, vb = q.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None]
    for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            fn = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
            if backend is None:
                record(case, "torch SDPA default (enable_gqa, no lse)", ms(fn), flops, nbytes)
            else:
                with sdpa_kernel(backend):
                    record(case, f"torch SDPA {backend.name}", ms(fn), flops, nbytes)
        except Exception as e:
            print(f"sdpa {backend} failed: {e!r:.300}", flush=True)


def split_prefill(t: int, ctx: int, rate: float) -> None:
    """A chat turn: ``t`` new tokens after ``ctx`` cached ones, the keys cut into 1..16 splits, for the
    default tiling and 128-row tiles of 8 warps (packed, as the default for grouped-query models)."""
    k_cache, v_cache, tables, q, lens, cu, flops = turn_inputs(t, ctx)
    case = f"turn t={t} ctx={ctx}"
    print(f"# {case}: flops floor {flops / rate * 1e3:.3f} ms", flush=True)
    default = pat._prefill_tiles
    for tiles in (None, (128, 64, 8, 3)):
        if tiles is not None:
            pat._prefill_tiles = lambda *_, tiles=tiles, **__: tiles
        block_q = pat._prefill_tiles(D, q.device, True)[0] // (H // KVH)
        for splits in (1, 2, 4, 8, 16, None):
            fn = functools.partial(pat.paged_prefill_attention_triton, q, k_cache, v_cache, tables, lens, cu,
                                   D**-0.5, None, t, max_seq_len=32768, num_splits=splits)
            chosen = splits or pat.prefill_num_splits(pat.triton.cdiv(t, block_q) * KVH, 32768, q.device)
            record(case, f"tiles={tiles or 'default'} splits={chosen}{'' if splits else ' (default)'}", ms(fn), flops)
    pat._prefill_tiles = default


def pack_sweep(rate: float) -> None:
    """Grouped-query packing (a KV head's 4 query heads in one tile) against one head per tile, over
    tilings: a session turn after histories of 1K-28K, fusion's scattered recompute (416 and 1184 of
    3104 positions) and whole prompts (512, 4096 tokens)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(f"turn t=257 ctx={c}", 257, c, None) for c in (1024, 4096, 16384, 28672)]
    for picked in (416, 1184):
        pos = torch.randperm(3072, generator=g)[: picked - 32].sort().values.tolist() + list(range(3072, 3104))
        cases.append((f"scattered {picked} of 3104", picked, 3104 - picked, torch.tensor(pos, device="cuda")))
    cases += [(f"prefill t={t}", t, 0, None) for t in (512, 4096)]
    for case, t, ctx, pos in cases:
        k_cache, v_cache, tables, q, lens, cu, flops = turn_inputs(t, ctx)
        if pos is not None:  # each query sees the keys up to its own position
            flops = 4 * H * D * float((pos + 1).sum())
        print(f"# {case}: flops floor {flops / rate * 1e3:.3f} ms", flush=True)
        for tiles in [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3)]:
            for pack in (False, True):
                fn = functools.partial(pat.paged_prefill_attention_triton, q, k_cache, v_cache, tables, lens, cu,
                                       D**-0.5, None, t, q_positions=pos, max_seq_len=32768, pack=pack)
                with_tiling(case, f"tiles={tiles} pack={pack}", tiles, fn, flops)


def scattered_sweep(rate: float) -> None:
    """Cache fusion's attention: the selected tokens and the question at their own positions over a
    3104-token prompt (the bench's 6 x 512 + 32), packed tiles over (BLOCK_M, BLOCK_N, warps, stages);
    the first layer's run of 2592 positions after the exact prefix beside the gradual-filtering sizes.
    Then torch's SDPA over the same keys made dense, with the exact mask as a boolean attn_mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cpu").manual_seed(0)
    tilings = [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    for picked in (416, 608, 1184, 2592):
        run = picked == 2592
        chosen = (torch.arange(512, 3072) if run
                  else torch.randperm(2560, generator=g)[: picked - 32].sort().values + 512)
        pos = torch.cat([chosen, torch.arange(3072, 3104)]).cuda()
        k_cache, v_cache, tables, q, lens, cu, _ = turn_inputs(picked, 3104 - picked)
        flops = 4 * H * D * float((pos + 1).sum())
        case = f"{'run' if run else 'scattered'} {picked} of 3104"
        print(f"# {case}: flops floor {flops / rate * 1e3:.4f} ms", flush=True)
        fn = functools.partial(pat.paged_prefill_attention_triton, q, k_cache, v_cache, tables, lens, cu,
                               D**-0.5, None, picked, q_positions=pos, max_seq_len=3104, pack=True)
        for tiles in tilings:
            with_tiling(case, f"tiles={tiles}", tiles, fn, flops)
        slots = torch.arange(3104, device="cuda")
        kd = k_cache.view(-1, KVH, D)[tables[0].long().repeat_interleave(PAGE) * PAGE + slots % PAGE]
        vd = v_cache.view(-1, KVH, D)[tables[0].long().repeat_interleave(PAGE) * PAGE + slots % PAGE]
        qb, kb, vb = q.transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None]
        mask = (slots[None, :] <= pos[:, None])[None, None]
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    fn = functools.partial(F.scaled_dot_product_attention, qb, kb, vb, attn_mask=mask,
                                           scale=D**-0.5, enable_gqa=True)
                    record(case, f"torch SDPA {backend.name} dense K/V, bool mask", ms(fn), flops)
            except Exception as e:
                print(f"sdpa {backend.name} failed: {e!r:.200}", flush=True)


def decode(batch: int, ctx: int, bw: float) -> None:
    k_cache, v_cache, tables = paged([ctx] * batch)
    q = torch.randn(batch, H, D, device="cuda", dtype=DT)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    nbytes = 2 * batch * ctx * KVH * D * 2
    case = f"decode b={batch} ctx={ctx}"
    print(f"# {case}: bytes floor {nbytes / bw * 1e3:.4f} ms", flush=True)
    for splits in (None, 1, 4):
        fn = lambda splits=splits: pat.paged_decode_attention_triton(
            q, k_cache, v_cache, tables, lens, D**-0.5, None, ctx, num_splits=splits
        )
        record(case, f"triton splits={splits or pat.decode_num_splits(batch, KVH, ctx, q.device)}", ms(fn),
               nbytes=nbytes)


def elementwise() -> None:
    t, hidden = 4096, 4096
    x = torch.randn(t, hidden, device="cuda", dtype=DT)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=DT)
    nbytes = 4 * t * hidden * 2
    record("add+rmsnorm 4096x4096", "triton", ms(lambda: fused_add_rms_norm_triton(x, r, w, 1e-5)), nbytes=nbytes)
    record("add+rmsnorm 4096x4096", "torch ref", ms(lambda: fused_add_rms_norm_ref(x, r, w, 1e-5)), nbytes=nbytes)
    qkv = torch.randn(t, (H + 2 * KVH) * D, device="cuda", dtype=DT)
    q, k, _ = qkv.split((H * D, KVH * D, KVH * D), dim=-1)
    q, k = q.view(t, H, D), k.view(t, KVH, D)
    cos, sin = cos_sin_table(inv_frequencies(D, 1e6), 32768)
    cos, sin = cos.cuda(), sin.cuda()
    pos = torch.randint(0, 32768, (t,), device="cuda")
    nbytes = 2 * t * (H + KVH) * D * 2
    record("rope q+k 4096 tok", "triton (one launch)", ms(lambda: apply_rope_qk_triton(q, k, pos, cos, sin)),
           nbytes=nbytes)
    record("rope q+k 4096 tok", "torch ref", ms(lambda: (apply_rope_ref(q, pos, cos, sin),
                                                        apply_rope_ref(k, pos, cos, sin))), nbytes=nbytes)


def engine_decode() -> None:
    """Decode steps of a random-weight Mistral-7B-shaped engine, with and without decode graphs."""
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams

    mc = ModelConfig.from_dict({
        "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "eos_token_id": 2,
    })
    eng = LLMEngine(EngineConfig(device="cuda", max_model_len=4096), random_weights=mc)
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    graphs = eng.runner.graphs
    for batch in (1, 16, 64):
        for use_graphs in (True, False):
            eng.runner.graphs = graphs if use_graphs else None
            params = SamplingParams(max_tokens=33, ignore_eos=True)
            for _ in range(batch):
                eng.add_request(torch.randint(3, 32000, (1024,)).tolist(), params)
            started = 0
            while started < batch:  # prefill every prompt (each then has its first token)
                started += sum(1 for o in eng.step() if len(o.token_ids) == 1)
            eng.step()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            steps = 0
            while eng.has_unfinished():
                eng.step()
                steps += 1
            end.record()
            torch.cuda.synchronize()
            step_ms = start.elapsed_time(end) / steps
            record(f"engine decode b={batch} ctx=1024", f"graphs={use_graphs}", step_ms, nbytes=weight_bytes)
    print(f"# weight bytes {weight_bytes / 1e9:.2f} GB", flush=True)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    bw, rate = ceilings()
    if "--pack" in sys.argv:  # grouped-query packing alone
        pack_sweep(rate)
        return _save()
    if "--scattered" in sys.argv:  # cache fusion's attention alone
        scattered_sweep(rate)
        return _save()
    for ctx in (1024, 4096, 16384, 28672):
        split_prefill(257, ctx, rate)
    if "--turn" in sys.argv:  # the session-turn cases alone
        return _save()
    for t in (512, 4096, 8192):
        prefill(t, 0, bw, rate)
    prefill(512, 3584, bw, rate)
    for batch, ctx in ((1, 1024), (64, 1024), (1, 8192), (64, 4096)):
        decode(batch, ctx, bw)
    elementwise()
    try:
        engine_decode()
    except Exception as e:
        print(f"engine decode failed: {e!r:.500}", flush=True)
    _save()


def _save() -> None:
    out = [a for a in sys.argv[1:] if not a.startswith("--")]
    if out:
        with open(out[0], "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
