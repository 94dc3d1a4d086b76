"""``ragfuse bench sessions``: multi-turn session reuse (AttentionStore) against recomputing history.

Three parts, each optional (``--parts``):

- ``ttft``: one turn of ``--new-tokens`` new tokens after a history of each ``--history`` length, on
  the engine: full recompute of the history (the RE baseline; on context overflow its oldest half is
  cut and recomputed) against the session path (history KV from host memory or from disk, loaded
  layer by layer while the new tokens are prefilled). Reports TTFT, the reduction, and the share of
  the load hidden behind compute. Disk runs drop the page cache first. Tier ``disk-prefetched``: the
  session is on disk when its job is queued and the look-ahead window fetches it into host memory
  before the job runs (``SessionStore.hint``); its TTFT is taken after the fetch, and the fetch time
  (what the queue ahead of the job must cover) is reported beside it. On CUDA, host-memory turns are
  also timed with the whole history copied to the GPU before the turn (the floor: ``ttft_read_buffer``),
  with the prefill graphs off (the layer-wise eager forward) for contrast, and as tier
  ``cpu-preloaded``: AttentionStore's read buffer, its first layers (as many as the measured copy and
  prefill times say the turn cannot hide, ``read_buffer_layers``) copied before the turn while the
  previous job runs, the rest during the turn; that early copy's time is its ``prefetch_ms``. Every
  TTFT includes planning the turn (the session lookup).
- ``replay``: the ShareGPT dev conversations replayed (Poisson arrivals, think time between turns,
  a FIFO job queue served by ``--servers`` slots) through ``SessionPlacement`` with each policy, KV
  sizes of the model shape, CPU and disk capacities as fractions of the working set. TTFT per job
  comes from rates measured in the ``ttft`` part (or given): prefill time per token, and load
  bandwidth per tier overlapped layer by layer with the new tokens' prefill.
- ``truncation``: perplexity of a continuation after the history overflowed a context window, with
  the default model's real weights on long text: token truncation with recompute (TT), truncation
  of the position-free stored KV re-rotated to its new positions (sessions), and naive truncation of
  KV that keeps its old positions (NKVT), for contrast.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ragfuse.shared_data import shared_data

from .args import choice_list, int_list, positive_float, positive_int
from .partial import Report
from .report import machine_info
from .shapes import SHAPES

SHAREGPT = str(shared_data("sharegpt_multiturn_dev.jsonl"))
PARTS = ("ttft", "replay", "truncation")


def replay_settings(text: str) -> list[tuple[str, float, float]]:
    """``--settings``: NAME:CPU:DISK items, the capacities non-negative fractions of the working set."""
    settings = []
    for item in text.split(","):
        try:
            name, cpu, disk = item.split(":")
            shares = float(cpu), float(disk)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected NAME:CPU:DISK items, got {item!r}") from exc
        if not name or not all(0 <= x < float("inf") for x in shares):
            raise argparse.ArgumentTypeError(f"expected a name and two finite shares >= 0, got {item!r}")
        settings.append((name, *shares))
    return settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sessions", help="multi-turn session reuse: TTFT vs recompute, placement replay, truncation")
    p.add_argument("--parts", type=choice_list(PARTS), default=list(PARTS), help="comma-separated: " + ", ".join(PARTS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device of the ttft and truncation parts (cpu: a small shape and short histories)")
    p.add_argument("--shape", default=None, choices=SHAPES,
                   help="random-weight shape for ttft (cuda default mistral-7b; cpu tiny-llama)")
    p.add_argument("--history", type=int_list, default=None, help="history lengths (cuda: 1K,4K,16K,28K)")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="ttft: new tokens of the timed turn")
    p.add_argument("--tiers", type=choice_list(TIERS), default=list(TIERS), help="comma-separated: " + ", ".join(TIERS))
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="ttft: timed turns per history length and tier, the median reported")
    p.add_argument("--data", default=SHAREGPT,
                   help="replay and truncation: ShareGPT JSONL conversations (default: the bundled dev set)")
    p.add_argument("--conversations", type=positive_int, default=600, help="replay: conversations replayed")
    p.add_argument("--replay-shape", default="mistral-7b", choices=SHAPES, help="replay: model shape for KV sizes")
    p.add_argument("--settings", type=replay_settings,
                   default=replay_settings("tight:0.05:0.15,medium:0.1:0.5,roomy:0.3:2.0"),
                   help="replay: NAME:CPU:DISK, capacities as fractions of the working set")
    p.add_argument("--arrival-rate", type=positive_float, default=2.0, help="replay: new conversations per second")
    p.add_argument("--think-s", type=positive_float, default=30.0,
                   help="replay: mean pause between a reply and the next turn")
    p.add_argument("--servers", type=positive_int, default=32, help="replay: jobs served at once")
    p.add_argument("--decode-s", type=positive_float, default=0.02, help="replay: seconds per answer token")
    p.add_argument("--rates", default=None, help="replay: results.json of an earlier ttft run to take rates from")
    p.add_argument("--model", default="smollm2-135m-instruct", help="truncation: real weights")
    p.add_argument("--window", type=positive_int, default=1024, help="truncation: context window")
    p.add_argument("--samples", type=positive_int, default=8, help="truncation: texts scored")
    p.add_argument("--out", default=None, help="output folder (default bench-results/sessions-DEVICE)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    parts = args.parts
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    stored_rates = _read_rates(args.rates) if args.rates and "replay" in parts else None  # before the ttft part
    results: dict[str, Any] = {"benchmark": "sessions", "machine": machine_info(args.device),
                               "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    report = Report(args.out or f"bench-results/sessions-{args.device}", "ragfuse bench sessions", results, parts,
                    plot=lambda fig: _plot(fig, results, report.rows), notes=lambda: _notes(results))
    with report.interruptible():
        if "ttft" in parts:
            report.begin("ttft")
            results["ttft"] = bench_ttft(args, report.rows)
        if "replay" in parts:
            report.begin("replay")
            results["replay"] = bench_replay(args, stored_rates or results.get("ttft", {}).get("rates"), report.rows)
        if "truncation" in parts:
            report.begin("truncation")
            results["truncation"] = bench_truncation(args, report.rows)
    path = report.write()
    print((path / "results.md").read_text())
    return 0


def _read_rates(path: str) -> dict[str, Any]:
    """The ``ttft`` rates of an earlier run's results.json, or a RagfuseError that says why not."""
    from ragfuse.engine import RagfuseError

    try:
        rates = json.loads(Path(path).read_text(encoding="utf-8"))["ttft"]["rates"]
    except OSError as exc:
        raise RagfuseError(f"--rates {path}: cannot read it ({exc.strerror or exc})") from exc
    except (ValueError, LookupError, TypeError) as exc:
        raise RagfuseError(f"--rates {path}: not the results.json of a ttft run ({exc!r})") from exc
    if not isinstance(rates, dict):
        raise RagfuseError(f"--rates {path}: its ttft rates are not an object")
    return rates


# ---- part 1: TTFT per turn ----------------------------------------------------------------------

def open_session(eng: Any, store: Any, sid: str, history: list[int], new: list[int]) -> list[int]:
    """Session ``sid`` holding ``history`` and its one-token reply (its KV computed by the turn's
    closing step), saved in ``store`` (flushed), and the whole conversation a next turn feeds:
    history, reply, ``new``."""
    from ragfuse.engine import SamplingParams

    eng.enable_sessions(store)
    rid = eng.add_session_request(sid, history, SamplingParams(max_tokens=1, ignore_eos=True))
    answer: list[int] = []
    while not answer:
        answer = [t for o in eng.step() if o.request_id == rid and o.finished for t in o.token_ids]
    eng.close_turns()
    store.flush()
    return history + answer + new


def _ttft_engine(args: argparse.Namespace, longest: int) -> Any:
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

    from .shapes import shape_config

    shape = args.shape or ("mistral-7b" if args.device == "cuda" else "tiny-llama")
    cfg = shape_config(shape)
    mc = ModelConfig.from_dict(cfg)
    n = longest + args.new_tokens + 64
    budget = int(mc.kv_bytes_per_token(torch.bfloat16 if args.device == "cuda" else torch.float32) * (n + 512) * 2)
    # the prefix tree off: the RE baseline recomputes the whole history every time (repeats included)
    return LLMEngine(EngineConfig(device=args.device, kv_cache_bytes=budget, max_num_batched_tokens=n,
                                  max_model_len=min(mc.max_position_embeddings, max(n + 64, 4096)), prefix_tree=False),
                     random_weights=mc), shape


TIERS = ("cpu", "disk", "disk-prefetched")


def bench_ttft(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``ttft`` part: its rows appended to ``rows`` as each is measured, returned with the rates
    they give (for the replay)."""
    from ragfuse.engine import SamplingParams
    from ragfuse.engine.sessions import SessionStore

    histories = args.history or ([1024, 4096, 16384, 28672] if args.device == "cuda" else [256, 1024])
    eng, shape = _ttft_engine(args, max(histories))
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    tiers = args.tiers
    first = len(rows)
    per_token_prefill: list[tuple[int, float]] = []
    bandwidth: dict[str, list[float]] = {t: [] for t in tiers if t in ("cpu", "disk")}
    kv_per_token = eng.model_config.kv_bytes_per_token(eng.dtype)

    def recompute(prompt: list[int]) -> float:
        sync()
        t = time.perf_counter()
        rid = eng.add_request(prompt, one)
        while True:
            outs = [o for o in eng.step() if o.request_id == rid]
            if outs:
                break
        sync()
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory(prefix="ragfuse-bench-sessions-") as tmp:
        bar = tqdm(total=len(histories) * (1 + len(tiers)), desc="bench sessions ttft")
        for hist in histories:
            history = torch.randint(3, vocab, (hist,), generator=gen).tolist()
            new = torch.randint(3, vocab, (args.new_tokens,), generator=gen).tolist()
            # RE: the whole history recomputed (its oldest half cut first when the window overflows)
            prompt = history + new
            if len(prompt) + 1 > eng.max_model_len:
                half = (len(history) - 4) // 2
                prompt = history[:4] + history[4 + half:] + new
            recompute(prompt[:64])  # warm-up
            re_s = statistics.median(recompute(prompt) for _ in range(args.repeats))
            per_token_prefill.append((len(prompt), re_s))
            bar.update(1)
            for tier in tiers:
                root = Path(tmp) / f"{tier}-{hist}" if tier != "cpu" else None
                store = SessionStore(root, eng.fingerprint, eng.dtype,
                                     cpu_bytes=(64 << 30) if tier == "cpu" else 0, disk_bytes=64 << 30)
                sid = f"s{hist}"
                conversation = open_session(eng, store, sid, history, new)
                staged = tier == "cpu" and eng.device.type == "cuda"
                keys = ("ttft", "plan", "pre", "alone", "eager", "hidden", "load", "prefetch")
                m: dict[str, list[float]] = {k: [] for k in keys}

                def turn_s(m: dict[str, list[float]] = m, sid: str = sid, conversation: list[int] = conversation,
                           new: list[int] = new, hist: int = hist, preload: int | None = None) -> float:
                    """TTFT of the turn (aborted after its first token: every round reuses the same history).
                    ``preload``: that many layers are copied into the read buffer between planning the turn
                    and starting it (as while the previous job runs); the copy's time is kept apart."""
                    sync()
                    t = time.perf_counter()
                    turn = eng.begin_session_turn(sid, conversation, 1, new_tokens=len(new))
                    t_plan = time.perf_counter()
                    if preload is not None:
                        eng.preload_session_turn(turn, preload)
                        sync()
                        m["prefetch"].append(time.perf_counter() - t_plan)
                    t_start = time.perf_counter()
                    rid = eng.start_session_turn(turn, one)
                    sync()
                    took = time.perf_counter() - t_start + t_plan - t
                    assert turn.fusion is not None and turn.reused == hist + 1, (turn.reused, hist)  # + the reply
                    m["plan"].append(t_plan - t)
                    m["hidden"].append(turn.fusion.load_hidden)
                    m["load"].append(turn.fusion.load_s)
                    eng.abort(rid)
                    return took

                for _ in range(args.repeats + 1):  # the first round warms up
                    if tier != "cpu":
                        store.disk.drop_cache(store._records[sid].key)
                    if tier == "disk-prefetched":  # on disk only, as a session queued behind others may be
                        store.close()
                        store = SessionStore(root, eng.fingerprint, eng.dtype, cpu_bytes=64 << 30,
                                             disk_bytes=64 << 30)
                        eng.enable_sessions(store)
                        t = time.perf_counter()
                        store.hint([sid])  # its job entered the look-ahead window: disk -> host memory
                        store.flush()
                        m["prefetch"].append(time.perf_counter() - t)
                        assert store.tier_of(sid) == "cpu", store.tier_of(sid)
                    m["ttft"].append(turn_s())
                    if staged:
                        # the read buffer: the history copied to the GPU while the previous job ran
                        turn = eng.begin_session_turn(sid, conversation, 1, new_tokens=len(new))
                        eng.preload_session_turn(turn)
                        sync()
                        t = time.perf_counter()
                        eng.abort(eng.start_session_turn(turn, one))
                        sync()
                        m["pre"].append(time.perf_counter() - t)
                        # the copy alone, nothing to overlap with
                        turn = eng.begin_session_turn(sid, conversation, 1, new_tokens=len(new))
                        sync()
                        t = time.perf_counter()
                        eng.preload_session_turn(turn)
                        sync()
                        m["alone"].append(time.perf_counter() - t)
                        turn.close()
                        # the same turn with the prefill graphs off: the layer-wise forward launched eagerly
                        graphs, eng.runner.prefill_graphs = eng.runner.prefill_graphs, None
                        try:
                            m["eager"].append(turn_s())
                        finally:
                            eng.runner.prefill_graphs = graphs
                        for k in ("plan", "hidden", "load"):
                            m[k].pop()  # the graphs-off round's own figures are not the turn's
                med = {k: statistics.median(v[1:]) for k, v in m.items() if len(v) > 1}
                ttft = med["ttft"]
                # staged: TTFT with the whole history on the GPU before the turn (planning included)
                floor = med["plan"] + med["pre"] if staged else None
                if staged:  # the share of the copy that did not add to TTFT, side by side
                    load_s = med["alone"]
                    hidden = 1 - max(0.0, ttft - floor) / load_s
                else:
                    load_s, hidden = med["load"], med["hidden"]
                if tier in bandwidth:
                    bandwidth[tier].append(hist * kv_per_token / load_s if load_s > 0 else float("inf"))
                row = {
                    "part": "ttft", "shape": shape, "history": hist, "new_tokens": len(new), "tier": tier,
                    "ttft_recompute_ms": re_s * 1e3, "ttft_session_ms": ttft * 1e3,
                    "ttft_reduction": 1 - ttft / re_s, "plan_ms": med["plan"] * 1e3, "load_ms": load_s * 1e3,
                    "load_hidden": hidden, "load_hidden_events": med["hidden"], "buffer_layers": None,
                    "ttft_read_buffer_ms": floor * 1e3 if floor else None,
                    "reduction_read_buffer": 1 - floor / re_s if floor else None,
                    "ttft_graphs_off_ms": med["eager"] * 1e3 if staged else None,
                    "prefetch_ms": med["prefetch"] * 1e3 if "prefetch" in med else None,
                    "kv_gb": hist * kv_per_token / 1e9,
                }
                rows.append(row)
                print(f"  history {hist:6d} tier {tier:15s}: recompute {re_s * 1e3:8.1f} ms, session "
                      f"{ttft * 1e3:7.1f} ms ({1 - ttft / re_s:.1%} lower), load hidden {hidden:.0%}"
                      + (f", whole history in the read buffer {floor * 1e3:.1f} ms, graphs off "
                         f"{med['eager'] * 1e3:.1f} ms" if floor else "")
                      + (f", prefetched in {med['prefetch'] * 1e3:.0f} ms" if "prefetch" in med else ""), flush=True)
                if floor:
                    rows.append(_preloaded_row(eng, row, turn_s, args.repeats, med["alone"], med["pre"], floor))
                store.close()
                eng.sessions = None
                bar.update(1)
        bar.close()
    rates = {
        "prefill_fit": _fit_prefill(per_token_prefill),
        "load_bytes_per_s": {t: statistics.median(b) for t, b in bandwidth.items() if b},
        "kv_bytes_per_token": kv_per_token, "shape": shape, "device": str(eng.device),
    }
    return {"rows": rows[first:], "rates": rates}


def _preloaded_row(
    eng: Any, row: dict[str, Any], turn_s: Any, repeats: int, load_s: float, prefill_s: float, floor: float,
) -> dict[str, Any]:
    """The host-memory turn with AttentionStore's read buffer: the first ``read_buffer_layers``
    layers (sized from the measured copy and prefill times so the rest of the copy hides behind the
    turn's layers) copied while the previous job runs, the rest at the turn, layer by layer. The
    buffer's copy time (what the previous job or the queue wait must cover) is ``prefetch_ms``."""
    from ragfuse.engine.sessions.source import read_buffer_layers

    layers = eng.model_config.num_layers
    k = read_buffer_layers(layers, load_s, prefill_s)
    m: dict[str, list[float]] = {key: [] for key in ("ttft", "plan", "hidden", "load", "prefetch")}
    for _ in range(repeats + 1):
        m["ttft"].append(turn_s(m, preload=k))
    med = {key: statistics.median(v[1:]) for key, v in m.items()}
    ttft, re_s = med["ttft"], row["ttft_recompute_ms"] / 1e3
    hidden = 1 - max(0.0, ttft - floor) / load_s
    print(f"  history {row['history']:6d} tier cpu-preloaded  : session {ttft * 1e3:7.1f} ms "
          f"({1 - ttft / re_s:.1%} lower), read buffer {k}/{layers} layers copied {med['prefetch'] * 1e3:.1f} ms "
          f"ahead, load hidden {hidden:.0%}", flush=True)
    return {**row, "tier": "cpu-preloaded", "ttft_session_ms": ttft * 1e3, "ttft_reduction": 1 - ttft / re_s,
            "plan_ms": med["plan"] * 1e3, "load_hidden": hidden, "load_hidden_events": med["hidden"],
            "buffer_layers": k, "ttft_graphs_off_ms": None, "prefetch_ms": med["prefetch"] * 1e3,
            "ttft_read_buffer_ms": None, "reduction_read_buffer": None}  # the floor is the cpu row's


def _fit_prefill(points: list[tuple[int, float]]) -> list[float]:
    """Least-squares ``t = a + b n + c n^2`` (attention makes long prefills superlinear)."""
    if len(points) < 3:
        n, t = points[-1]
        return [0.0, t / n, 0.0]
    xs = torch.tensor([[1.0, n, n * n] for n, _ in points], dtype=torch.float64)
    ys = torch.tensor([t for _, t in points], dtype=torch.float64)
    sol = torch.linalg.lstsq(xs, ys).solution
    return [float(v) for v in sol]


# ---- part 2: placement replay -------------------------------------------------------------------

DEFAULT_RATES = {  # measured on an H100 (mistral-7b shape); replaced by a run's own ``ttft`` rates
    "prefill_fit": [0.0, 3.5e-5, 6e-10], "load_bytes_per_s": {"cpu": 20e9, "disk": 2e9},
    "kv_bytes_per_token": 131072, "shape": "mistral-7b", "device": "assumed",
}


def _conversation_tokens(path: str, limit: int) -> list[list[tuple[int, int]]]:
    """Per conversation, per turn: (user tokens, answer tokens), estimated as characters / 4 (a
    Llama-family tokenizer averages about four characters a token on English chat)."""
    convs = []
    for line in Path(path).read_text().splitlines()[:limit]:
        msgs = json.loads(line)["conversations"]
        turns: list[tuple[int, int]] = []
        user = 0
        for m in msgs:
            n = max(1, math.ceil(len(m["value"]) / 4))
            if m["from"] == "human":
                user += n
            elif user:
                turns.append((user, n))
                user = 0
        if turns:
            convs.append(turns)
    return convs


def simulate(
    convs: list[list[tuple[int, int]]], policy: str, cpu_bytes: int, disk_bytes: int, rates: dict[str, Any],
    arrival_rate: float, think_s: float, servers: int, decode_s: float, max_len: int, seed: int = 0,
) -> dict[str, float]:
    """Replay ``convs`` through ``SessionPlacement``: event-driven, jobs served FIFO by ``servers``
    slots; the waiting queue is the policy's look-ahead. Returns hit rates and mean TTFT."""
    from ragfuse.engine.sessions import SessionPlacement, make_policy

    rng = random.Random(seed)
    a, b, c = rates["prefill_fit"]
    bw = rates["load_bytes_per_s"]
    per_tok = rates["kv_bytes_per_token"]

    def prefill(n: int) -> float:
        return max(a + b * n + c * n * n, 0.0)

    place = SessionPlacement(cpu_bytes, disk_bytes, make_policy(policy))
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, conversation)
    seq = 0
    t = 0.0
    for i in range(len(convs)):
        t += rng.expovariate(arrival_rate)
        events.append((t, seq, "arrive", i))
        seq += 1
    heapq.heapify(events)
    turn_of = [0] * len(convs)
    history = [0] * len(convs)  # tokens in the conversation so far
    queue: list[int] = []
    busy = 0
    io_free = 0.0
    fetched_at: dict[str, float] = {}
    hits = {"cpu": 0, "disk": 0, "miss": 0}
    ttfts: list[float] = []
    queued: list[int] = []
    first_turn = 0
    while events:
        now, _, kind, ci = heapq.heappop(events)
        if kind == "arrive":
            queue.append(ci)
        else:
            busy -= 1
            user, answer = convs[ci][turn_of[ci]]
            history[ci] = min(history[ci] + user + answer, max_len)  # overflow: cut on the stored KV
            place.admit(f"c{ci}", history[ci] * per_tok, now, [f"c{q}" for q in queue])
            turn_of[ci] += 1
            if turn_of[ci] < len(convs[ci]):
                heapq.heappush(events, (now + rng.expovariate(1 / think_s), seq, "arrive", ci))
                seq += 1
        for move in place.prefetch([f"c{q}" for q in queue]):
            if move.action == "fetch":
                nbytes = place.sessions[move.session_id].nbytes
                io_free = max(io_free, now) + nbytes / bw.get("disk", 2e9)
                fetched_at[move.session_id] = io_free
        while queue and busy < servers:
            queued.append(len(queue))
            ci = queue.pop(0)
            sid = f"c{ci}"
            user, answer = convs[ci][turn_of[ci]]
            new = user
            if turn_of[ci] == 0:
                first_turn += 1
                tier = None
            else:
                tier = place.access(sid, now)
                if tier == "cpu" and fetched_at.get(sid, 0.0) > now:
                    tier = "disk"  # its prefetch has not finished: read from disk after all
                hits[tier or "miss"] += 1
            hist = history[ci]
            if tier is None:
                ttft = prefill(min(hist + new, max_len))
            else:
                # layer-wise: the load overlaps the new tokens' prefill; the longer of the two shows
                ttft = max(prefill(new), hist * per_tok / bw.get(tier, 2e9))
            ttfts.append(ttft)
            busy += 1
            heapq.heappush(events, (now + ttft + answer * decode_s, seq, "done", ci))
            seq += 1
    later = hits["cpu"] + hits["disk"] + hits["miss"]
    return {
        "hit_rate": (hits["cpu"] + hits["disk"]) / later if later else 0.0,
        "cpu_hit_share": hits["cpu"] / max(hits["cpu"] + hits["disk"], 1),
        "hits_cpu": hits["cpu"], "hits_disk": hits["disk"], "misses": hits["miss"], "first_turns": first_turn,
        "mean_ttft_ms": 1e3 * statistics.fmean(ttfts) if ttfts else 0.0,
        "mean_queue": statistics.fmean(queued) if queued else 0.0,
    }


def bench_replay(args: argparse.Namespace, rates: dict[str, Any] | None, rows: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """The ``replay`` part: a row per setting and policy, appended to ``rows`` as each is simulated."""
    from ragfuse.engine import ModelConfig

    from .shapes import shape_config

    rates = rates or DEFAULT_RATES
    convs = _conversation_tokens(args.data, args.conversations)
    mc = ModelConfig.from_dict(shape_config(args.replay_shape))
    per_tok = mc.kv_bytes_per_token(torch.bfloat16)
    rates = {**rates, "kv_bytes_per_token": per_tok}
    max_len = mc.max_position_embeddings
    working = sum(min(sum(u + a for u, a in c), max_len) for c in convs) * per_tok
    first = len(rows)
    settings = args.settings
    bar = tqdm(total=len(settings) * 3, desc="bench sessions replay")
    for name, cpu_frac, disk_frac in settings:
        for policy in ("scheduler", "lru", "fifo"):
            r = simulate(convs, policy, int(cpu_frac * working), int(disk_frac * working), rates,
                         args.arrival_rate, args.think_s, args.servers, args.decode_s, max_len)
            rows.append({"part": "replay", "setting": name, "cpu_share": cpu_frac,
                         "disk_share": disk_frac, "policy": policy, **r})
            bar.update(1)
    bar.close()
    for name, *_ in settings:
        by = {r["policy"]: r for r in rows[first:] if r["setting"] == name}
        print(f"  replay {name}: hit rate scheduler {by['scheduler']['hit_rate']:.1%} "
              f"({by['scheduler']['cpu_hit_share']:.0%} from CPU), lru {by['lru']['hit_rate']:.1%}, "
              f"fifo {by['fifo']['hit_rate']:.1%}", flush=True)
    return {"rows": rows[first:], "working_set_gb": working / 1e9, "conversations": len(convs), "rates": rates}


# ---- part 3: truncation quality ----------------------------------------------------------------

def _long_texts(path: str, tokenizer: Any, length: int, count: int) -> list[list[int]]:
    """Token lists of ``length`` tokens, each from one long ShareGPT conversation's text."""
    out = []
    for line in Path(path).read_text().splitlines():
        text = "\n\n".join(m["value"] for m in json.loads(line)["conversations"])
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def bench_truncation(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``truncation`` part: its rows (one per method, from all texts) appended to ``rows`` at its end."""
    from ragfuse.engine import EngineConfig, LLMEngine
    from ragfuse.engine.fusion import FusionMode, Segment, TensorKV

    eng = LLMEngine(EngineConfig(model=args.model, device="cpu" if args.device == "cpu" else args.device))
    window = args.window
    new = window // 4
    hist_len = window  # the history alone fills the window: the turn overflows it
    texts = _long_texts(args.data, eng.tokenizer, hist_len + new, args.samples)
    keep_first = 4
    drop = (hist_len - keep_first) // 2  # RE's ratio 0.5
    rotary = eng.runner.model.model.rotary
    nll: dict[str, list[float]] = {"tt": [], "sessions": [], "nkvt": []}
    for ids in tqdm(texts, desc="bench sessions truncation"):
        hist, cont = ids[:hist_len], ids[hist_len:]
        kept = hist[:keep_first] + hist[keep_first + drop:]
        kept_at = torch.tensor(list(range(keep_first)) + list(range(keep_first + drop, hist_len)))
        targets = torch.tensor(cont[1:])
        # TT: the truncated history recomputed from scratch, then the continuation
        logits = eng.score(kept + cont, last_n=len(cont))[:-1]
        nll["tt"].append(float(torch.nn.functional.cross_entropy(logits, targets)))
        (k, v), = eng.compute_kv([hist])  # the history's KV, K without position, as a session stores it
        k, v = k[:, kept_at], v[:, kept_at]
        # NKVT: K that keeps its old positions: rotated by (old - new) before the fusor rotates it to new
        old_pos = kept_at.to(eng.device)
        delta = old_pos - torch.arange(len(kept_at), device=eng.device)
        k_naive = torch.stack([rotary(k[i], delta) for i in range(k.shape[0])])
        for name, kk in (("sessions", k), ("nkvt", k_naive)):
            segs = [Segment(kept, TensorKV(kk, v)), Segment(cont[:1])]
            logits, _ = eng.score_fused(segs, cont[1:], FusionMode.REUSE)
            nll[name].append(float(torch.nn.functional.cross_entropy(logits[:-1], targets)))
    ppl = {k: math.exp(statistics.fmean(v)) for k, v in nll.items()}
    rows_out = [{"part": "truncation", "method": m, "perplexity": ppl[m], "delta_vs_tt": ppl[m] - ppl["tt"],
                 "window": window, "history": hist_len, "cut": drop, "scored_tokens": new - 1, "texts": len(texts)}
                for m in ("tt", "sessions", "nkvt")]
    print(f"  truncation: PPL TT {ppl['tt']:.3f}, sessions {ppl['sessions']:.3f}, naive {ppl['nkvt']:.3f}", flush=True)
    rows += rows_out
    return {"rows": rows_out, "perplexity": ppl}


# ---- report -------------------------------------------------------------------------------------

def _notes(results: dict[str, Any]) -> str:
    lines = []
    if "ttft" in results:
        r = results["ttft"]["rates"]
        lines.append(f"TTFT: random-weight {r['shape']} on {r['device']}; session KV in host memory (pinned) or on "
                     "disk (page cache dropped; disk-prefetched: fetched into host memory by the look-ahead "
                     "window before the turn, prefetch_ms = that fetch); recompute = RE baseline (prefill of the "
                     "whole history); cpu = copied to the GPU from the turn's start, layer by layer beside the "
                     "new tokens' layers; cpu-preloaded = AttentionStore's read buffer: its first buffer_layers "
                     "copied while the previous job ran (prefetch_ms = that copy), the rest during the turn; "
                     "read buffer columns = the whole history on the GPU before the turn (the floor); "
                     "load_hidden = share of the copy time (load_ms, alone) that did not add to TTFT over that "
                     "floor; graphs off = the same turn with the layer-wise forward launched eagerly.")
    if "replay" in results:
        rp = results["replay"]
        lines.append(f"Replay: {rp['conversations']} ShareGPT conversations, working set {rp['working_set_gb']:.1f} GB "
                     f"of KV; capacities as shares of it; rates from {rp['rates'].get('device', '?')}.")
    if "truncation" in results:
        lines.append("Truncation: perplexity of the continuation after the history overflowed the window; "
                     "TT = token truncation + recompute, sessions = position-free KV cut and re-rotated, "
                     "nkvt = KV cut with its old positions kept.")
    return "\n".join(lines)


def _plot(fig: Any, results: dict[str, Any], table: list[dict[str, Any]]) -> None:
    """The finished parts, and the ttft part's rows in ``table`` also while it runs (a run stopped in it)."""
    ttft = [r for r in table if r["part"] == "ttft"]
    parts = [p for p in ("ttft", "replay", "truncation") if p in results or (p == "ttft" and ttft)]
    made = fig.subplots(1, len(parts), squeeze=False)[0]
    axes = dict(zip(parts, made, strict=True))
    if ttft:
        ax = axes["ttft"]
        rows = ttft
        for tier in sorted({r["tier"] for r in rows}):
            rr = [r for r in rows if r["tier"] == tier]
            ax.plot([r["history"] for r in rr], [r["ttft_session_ms"] for r in rr], "o-", label=f"session ({tier})")
        for key, label in (("ttft_read_buffer_ms", "session (cpu, whole history on GPU before)"),
                           ("ttft_graphs_off_ms", "session (cpu, graphs off)")):
            rr = [r for r in rows if r.get(key) is not None]
            if rr:
                ax.plot([r["history"] for r in rr], [r[key] for r in rr], "x:", label=label)
        rr = [r for r in rows if r["tier"] == rows[0]["tier"]]
        ax.plot([r["history"] for r in rr], [r["ttft_recompute_ms"] for r in rr], "s--", label="recompute")
        ax.set_xlabel("history tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("TTFT per turn")
    if "replay" in results:
        ax = axes["replay"]
        rows = results["replay"]["rows"]
        names = list(dict.fromkeys(r["setting"] for r in rows))
        for j, pol in enumerate(("scheduler", "lru", "fifo")):
            ax.bar([i + 0.27 * j for i in range(len(names))],
                   [next(r["hit_rate"] for r in rows if r["setting"] == n and r["policy"] == pol) for n in names],
                   width=0.27, label=pol)
        ax.set_xticks([i + 0.27 for i in range(len(names))], names)
        ax.set_ylabel("hit rate")
        ax.legend()
        ax.set_title("replay")
    if "truncation" in results:
        ax = axes["truncation"]
        ppl = results["truncation"]["perplexity"]
        ax.bar(list(ppl), list(ppl.values()))
        ax.set_yscale("log")
        ax.set_ylabel("perplexity")
        ax.set_title("truncation")
