"""Scratch: relay's context part (each request's own c tokens, decode) as one program per (request, page, group of
KV heads): no dependent chain beyond the page's block id, partials merged per (request, head) after. Against the
shipped context kernel (decode_partials_triton) at b=32, s=2K, c=128, L2-cold (cycling data copies)."""
import functools
import json
import sys

import torch
import triton
import triton.language as tl

from ragfuse.bench.relay import _timer, cases, cycling
from ragfuse.kernels.paged_attention import paged_decode_attention_ref
from ragfuse.kernels.paged_attention_triton import decode_partials_triton, split_buffers
from ragfuse.kernels.relay_triton import relay_context_splits


@triton.jit
def _page_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, acc_ptr, ml_ptr, scale_log2, pages, max_pages,
                 stride_qb, stride_kb, stride_kt, stride_tb,
                 HB: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // pages
    p = pid % pages
    hg = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    t = p * PAGE + tl.arange(0, PAGE)
    t_ok = t < n
    blk = tl.load(table_ptr + b * stride_tb + p).to(tl.int64)
    kvh = hg * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    # K, V [PAGE, HB, D]
    off = blk * stride_kb + tl.arange(0, PAGE)[:, None, None] * stride_kt + kvh[None, :, None] * D + d[None, None, :]
    k = tl.load(k_ptr + off, mask=t_ok[:, None, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + off, mask=t_ok[:, None, None], other=0.0).to(tl.float32)
    for j in tl.static_range(G):
        heads = kvh * G + j
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * D + d[None, :]).to(tl.float32)  # [HB, D]
        s = tl.sum(k * q[None, :, :], 2) * scale_log2  # [PAGE, HB]
        s = tl.where(t_ok[:, None], s, float("-inf"))
        m = tl.max(s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        e = tl.exp2(s - m_safe[None, :])
        l_ = tl.sum(e, 0)
        acc = tl.sum(e[:, :, None] * v, 0)  # [HB, D]
        row = (b * max_pages + p) * (HB * tl.num_programs(1) * G) + heads
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + row * 2, m)
        tl.store(ml_ptr + row * 2 + 1, l_)


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, out_ptr, lse_ptr, lens_ptr, H, max_pages, D: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    pages = tl.cdiv(n, PAGE)
    d = tl.arange(0, D)
    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([D], tl.float32)
    for p in range(0, pages):
        row = (b * max_pages + p) * H + h
        m = tl.load(ml_ptr + row * 2)
        l_ = tl.load(ml_ptr + row * 2 + 1)
        a = tl.load(acc_ptr + row * D + d)
        m_new = tl.maximum(m_run, m)
        c_old = tl.exp2(m_run - m_new)
        c_new = tl.exp2(m - m_new)
        acc = acc * c_old + a * c_new
        l_run = l_run * c_old + l_ * c_new
        m_run = m_new
    tl.store(out_ptr + (b * H + h) * D + d, (acc / l_run).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + b * H + h, (m_run + tl.log2(l_run)) * 0.6931471805599453)


def page_context(x, acc, ml, out, lse, hb):
    b, h, d = x.q.shape
    kvh = x.k.shape[2]
    pages = x.own.shape[1]
    _page_kernel[(b * pages, kvh // hb)](x.q, x.k, x.v, x.own, x.own_lens, acc, ml, x.scale * 1.4426950408889634,
                                         pages, pages, x.q.stride(0), x.k.stride(0), x.k.stride(1), x.own.stride(0),
                                         HB=hb, G=h // kvh, D=d, PAGE=x.k.shape[1], num_warps=4)
    _merge_kernel[(b, h)](acc, ml, out, lse, x.own_lens, h, pages, D=d, PAGE=x.k.shape[1], num_warps=1)
    return out, lse


dev = torch.device("cuda")
timer = _timer(dev)
for shape, heads, kvh in (("llama-2-7b", 32, 32), ("mistral-7b", 32, 8)):
    s, c, b = 2048, 128, 32
    shared, _ = cases(heads, kvh, 128, s, c, b, dev, torch.bfloat16)
    one = shared[0]
    want = paged_decode_attention_ref(one.q, one.k, one.v, one.own, one.own_lens, one.scale)
    ctx_splits = relay_context_splits(b, kvh, c, dev)
    parts = [(x, *split_buffers(b, ctx_splits, heads, 128, dev)) for x in shared]
    ship = [functools.partial(decode_partials_triton, x.q, x.k, x.v, x.own, x.own_lens, x.scale, None, po, pl,
                              ctx_splits) for x, po, pl in parts]
    t_ship = timer(cycling(ship))
    print(json.dumps({"shape": shape, "what": "shipped context partials", "us": round(t_ship * 1e3, 1),
                      "splits": ctx_splits, "mb": round(one.kv_bytes(b * c) / 1e6, 1)}), flush=True)
    pages = one.own.shape[1]
    for hb in (1, 2, 4, 8):
        if kvh % hb:
            continue
        bufs = [(x, torch.empty(b * pages * heads, 128, device=dev), torch.empty(b * pages * heads, 2, device=dev),
                 torch.empty_like(x.q), torch.empty(b, heads, device=dev)) for x in shared]
        try:
            got = page_context(*bufs[0], hb)
            err = float((got[0].float() - want[0].float()).norm() / want[0].float().norm())
            lerr = float((got[1] - want[1]).abs().max())
            t = timer(cycling([lambda a=a, hb=hb: page_context(*a, hb) for a in bufs]))
            print(json.dumps({"shape": shape, "what": f"page programs hb={hb}", "us": round(t * 1e3, 1),
                              "rel_err": round(err, 5), "lse_err": round(lerr, 5)}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"shape": shape, "hb": hb, "error": str(e)[:300]}), flush=True)
    sys.stdout.flush()
