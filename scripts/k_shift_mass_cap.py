"""Question-aware variants of the stale shift's K part (scratch study, CPU torch reference).

Wraps ``layer_step.front``: the shipped per-segment (K, V) shift is computed as in the engine, then
its K part (per segment s, KV head g: delta[s, g] before RoPE) is modified using the question's
fresh queries at that layer (the active rows after the last stored position):

  qn1     project delta[s,g] off the mean "mass direction" u (rank 1): u_{j,h} = sum_t w_{jht} R(p_t)^T qrot_{jh}
          over the passage's stored tokens t (w = softmax of the question's stored scores inside the passage),
          so that the first-order change of the question's (mean) log attention mass to the passage is zero.
  qn3     same, projecting off the span of the 3 per-query-head means of u (GQA group of 3).
  awK     K shift = share x attention-weighted mean of (fresh - stored) over the passage's recomputed tokens,
          weights = question's mean (over question tokens, group's heads) in-passage softmax attention to each
          token (stored scores). V shift unchanged.
  guard   keep delta[s,g] only if, on the passage's recomputed tokens, the question's log-mass
          (logsumexp of scale*q.k over those tokens) with stored+delta K is closer (squared error, mean over
          question tokens and the group's heads) to the fresh one than with stored K; else zero it.
  qnlast  qn1 for the passage next to the question only.
  capC    cap the K shift's first-order change of the question's mean log mass to the passage at C nats
          (per passage and KV head): where |scale * mean(u) . delta| > C, remove just enough of delta along
          mean(u) to bring it to +-C; the rest of delta is kept (cap2: C = 2). cap2 is now the engine's
          own (``SelectionPolicy.k_mass_cap``, on by default); this study turns that off, so "shipped" here is
          the shift without it.

Results: results/fusion-quality/k-shift-mass-cap.md (the engine's: k-mass-cap-engine/).

    OMP_NUM_THREADS=1 nice .venv/bin/python scripts/k_shift_mass_cap.py --cases 54,20,21 --variants shipped,cap2
    (--dataset wikimqa_dev.json for 2WikiMQA; --diag FILE writes the shipped run's per-layer mass figures)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import torch
from study_cases import study_cases

import ragfuse.engine.fusion.layer_step as layer_step
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.kernels.rope import apply_rope_ref
from ragfuse.quality import mode_kl

STATE: dict[str, Any] = {"cfg": None, "layer": 0, "diag": None, "record": None, "fullk": None}
SHIPPED = {"front": layer_step.front, "shift": layer_step.segment_shift}


def modify_k(cfg: str, mk: torch.Tensor, q: torch.Tensor, k_raw: torch.Tensor, k_st: torch.Tensor, at: torch.Tensor,
             positions: torch.Tensor, index: Any, rotary: Any, scale: float, share_k: float) -> torch.Tensor:
    spare = index.num_segments - 1
    qmask = (index.active_segment == spare) & (positions > at.max())
    if not bool(qmask.any()):
        return mk
    cos, sin = rotary.cos, rotary.sin
    qr = apply_rope_ref(q[qmask].float(), positions[qmask], cos, sin)  # [J, H, D]
    J, H, D = qr.shape
    KVH = k_st.shape[1]
    grp = H // KVH
    half = D // 2

    def per_kvh(x: torch.Tensor) -> list[float]:
        """[J, H] -> its mean per KV head (over the question's tokens and the group's query heads)."""
        return [round(float(v), 3) for v in x.view(J, KVH, grp).mean((0, 2))]
    out = mk.clone()
    diag = STATE["diag"]
    for s in range(spare):
        act = (index.active_segment == s).nonzero().flatten()
        if act.numel() == 0:
            continue
        st_idx = (index.stored_segment == s).nonzero().flatten()
        p_t = at.index_select(0, st_idx)
        kst_rot = apply_rope_ref(k_st.index_select(0, st_idx).float(), p_t, cos, sin)  # [T, KVH, D]
        kexp = kst_rot.repeat_interleave(grp, dim=1)  # [T, H, D]
        sc = torch.einsum("jhd,thd->jht", qr, kexp) * scale
        w = sc.softmax(-1)  # [J, H, T]
        delta = mk[s]  # [KVH, D]
        rows = index.active_rows.index_select(0, act)
        p_a = positions.index_select(0, act)
        use_u = cfg in ("qn1", "qn3") or cfg.startswith("cap") or (cfg == "qnlast" and s == spare - 1)
        if use_u or diag is not None:
            C = torch.einsum("jht,tf->jhf", w, cos[p_t].float())
            S = torch.einsum("jht,tf->jhf", w, sin[p_t].float())
            q1, q2 = qr[..., :half], qr[..., half:]
            u = torch.cat((q1 * C + q2 * S, q2 * C - q1 * S), dim=-1)  # [J, H, D]
            ug = u.view(J, KVH, grp, D)
        if cfg.startswith("cap"):
            cap = float(cfg[3:])
            new = delta.clone()
            for g in range(KVH):
                ub = ug[:, g].mean((0, 1))
                pm = scale * float(ub @ delta[g])
                if abs(pm) > cap:
                    new[g] = delta[g] - ((pm - cap * (1 if pm > 0 else -1)) / (scale * float(ub @ ub))) * ub
            out[s] = new
        if cfg in ("qn1", "qn3") or (cfg == "qnlast" and s == spare - 1):
            new = torch.empty_like(delta)
            for g in range(KVH):
                basis = ug[:, g].mean((0, 1))[None] if cfg != "qn3" else ug[:, g].mean(0)  # [1 or grp, D]
                Qb, _ = torch.linalg.qr(basis.T)  # [D, r]
                new[g] = delta[g] - Qb @ (Qb.T @ delta[g])
            out[s] = new
        elif cfg == "awK":
            wg = w.mean(0).view(KVH, grp, -1).mean(1)  # [KVH, T]
            # stored row r -> index within segment: st_idx sorted; rows of segment s are st_idx
            loc = torch.searchsorted(st_idx, rows)
            wa = wg[:, loc].T  # [A, KVH]
            dk = k_raw.index_select(0, act).float() - k_st.index_select(0, rows).float()  # [A, KVH, D]
            out[s] = share_k * (wa[..., None] * dk).sum(0) / wa.sum(0)[:, None].clamp(min=1e-30)
        if cfg == "guard" or diag is not None:
            kf = apply_rope_ref(k_raw.index_select(0, act).float(), p_a, cos, sin)
            ks0 = k_st.index_select(0, rows).float()
            ks = apply_rope_ref(ks0, p_a, cos, sin)
            ksh = apply_rope_ref(ks0 + delta[None], p_a, cos, sin)

            def lse(kk: torch.Tensor) -> torch.Tensor:
                return (torch.einsum("jhd,ahd->jha", qr, kk.repeat_interleave(grp, dim=1)) * scale).logsumexp(-1)

            lf, ls, lsh = lse(kf), lse(ks), lse(ksh)  # [J, H]
            e_st = ((ls - lf) ** 2).view(J, KVH, grp).mean((0, 2))
            e_sh = ((lsh - lf) ** 2).view(J, KVH, grp).mean((0, 2))
            if cfg == "guard":
                out[s] = torch.where((e_sh < e_st)[:, None], delta, torch.zeros_like(delta))
            if diag is not None and STATE["fullk"] is not None:
                stale = torch.ones(st_idx.numel(), dtype=torch.bool)
                stale[torch.searchsorted(st_idx, rows)] = False
                ps = p_t[stale]
                kt = apply_rope_ref(STATE["fullk"][STATE["layer"]].index_select(0, ps).float(), ps, cos, sin)
                k0 = k_st.index_select(0, st_idx[stale]).float()
                t_true, t_st = lse(kt), lse(apply_rope_ref(k0, ps, cos, sin))
                t_sh = lse(apply_rope_ref(k0 + delta[None], ps, cos, sin))
                diag_extra = {"stale_true_minus_st": per_kvh(t_true - t_st),
                              "stale_shift_minus_st": per_kvh(t_sh - t_st)}
            else:
                diag_extra = {}
            if diag is not None:
                pred = (scale * torch.einsum("jhd,hd->jh", u, delta.repeat_interleave(grp, dim=0)))
                diag.append({"layer": STATE["layer"], "seg": s, "n_act": int(act.numel()),
                             "pred_dmass_stale": round(float(pred.mean()), 4),
                             "pred_dmass_stale_per_kvh": per_kvh(pred),
                             "rec_fresh_minus_st": round(float((lf - ls).mean()), 4),
                             "rec_shift_minus_st": round(float((lsh - ls).mean()), 4),
                             "err_st": [round(float(x), 3) for x in e_st],
                             "err_sh": [round(float(x), 3) for x in e_sh], **diag_extra})
    return out


def front(layer: Any, kv_cache: Any, rotary: Any, stored: Any, hidden: Any, residual: Any, positions: torch.Tensor,
          slots: Any, shift: Any = None, keep: bool = True) -> Any:
    """The engine's own ``front``, with what the K shift's variants read stashed in ``STATE``: the layer's fresh
    queries (from its ``project``), the stored rows' positions, the rotary tables and the attention scale."""
    attn = layer.self_attn
    project = attn.project

    def capture(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k_raw, v = project(h)
        if STATE["record"] is not None:
            STATE["record"].append(k_raw.detach().clone())
        STATE.update(q=q, positions=positions, at=None if stored is None else stored[2], rotary=rotary,
                     scale=attn.attn.scale)
        return q, k_raw, v

    attn.project = capture
    try:
        out = SHIPPED["front"](layer, kv_cache, rotary, stored, hidden, residual, positions, slots, shift, keep)
    finally:
        del attn.project  # the model's own method again
    STATE["layer"] += 1
    return out


def segment_shift(index: Any, k_new: torch.Tensor, v_new: torch.Tensor, k_st: torch.Tensor,
                  v_st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's shift, its K part changed by ``STATE['cfg']``."""
    mk, mv, seg = SHIPPED["shift"](index, k_new, v_new, k_st, v_st)
    if STATE["cfg"] != "shipped" or STATE["diag"] is not None:
        mk = modify_k(STATE["cfg"], mk, STATE["q"], k_new, k_st, STATE["at"], STATE["positions"], index,
                      STATE["rotary"], STATE["scale"], float(index.share[0]))
    return mk, mv, seg


def install() -> None:
    """Route the engine's fused prefill through ``front`` and ``segment_shift`` above (CPU, torch reference)."""
    layer_step.front = front
    layer_step.segment_shift = segment_shift


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="musique_dev.json")
    ap.add_argument("--cases", required=True)
    ap.add_argument("--variants", default="shipped,qn1,qn3,awK,guard")
    ap.add_argument("--diag", default="", help="write diagnostics of the shipped run to this file")
    ap.add_argument("--ratio", type=float, default=0.15)
    args = ap.parse_args()
    engine, cases = study_cases(args.dataset, args.cases)
    picks = args.cases.split(",")
    install()
    # the engine's own cap (``SelectionPolicy.k_mass_cap``) off: the variants here replace it
    policy = replace(SelectionPolicy.default(), k_mass_cap=0.0).with_ratio(args.ratio)
    variants = args.variants.split(",")
    totals = dict.fromkeys(variants, 0.0)
    for i, case in cases:
        row = {}
        if args.diag:
            STATE.update(record=[], layer=0, cfg="shipped", diag=None)
            mode_kl(engine, case, "full", policy)
            STATE.update(fullk=STATE["record"], record=None)
        for name in variants:
            STATE.update(cfg=name, layer=0, diag=[] if (args.diag and name == "shipped") else None)
            row[name] = round(mode_kl(engine, case, "fuse", policy)[1], 5)
            totals[name] += row[name] / len(picks)
            if STATE["diag"] is not None:
                with open(args.diag, "a") as f:
                    for d in STATE["diag"]:
                        f.write(json.dumps({"case": i, **d}) + "\n")
        print(json.dumps({"case": i, "kl_tf": row}), flush=True)
    print(json.dumps({"mean_kl_tf": {k: round(v, 5) for k, v in totals.items()}}), flush=True)


if __name__ == "__main__":
    main()
