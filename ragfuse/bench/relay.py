"""``ragfuse bench relay``: RelayAttention against reading a shared system prompt per request.

(a) The attention op of one decode step, on the same cache data: our paged decode kernel, each
request's block table starting with the system prompt's (shared) blocks, against relay (system part
for the whole batch + context part per request, one fused reduction), next to the paper's
theoretical speedup p = (s+c+2g)/(s/b+c+7g) for g query heads per KV head.
(b) End to end, random-weight models of real shapes: output tokens/s of a batch of requests behind a
registered system prompt, with relay, with the system prompt's blocks shared but no relay, and with
no sharing (every request computes and stores the whole prompt). Request and answer lengths follow
the first turn of ShareGPT conversations (about 4 characters a token: the random models have no
tokenizer), capped by ``--max-prompt``/``--max-output``.

On CUDA the op times are medians of CUDA-graph replays; on CPU (smoke runs on tiny shapes) the torch
references are timed by wall clock.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ragfuse.shared_data import shared_data

from .args import choice_list, int_list, positive_int
from .partial import Report
from .report import machine_info
from .shapes import SHAPES, shape_config

SHAREGPT = str(shared_data("sharegpt_multiturn_dev.jsonl"))
MODES = ("none", "shared", "relay")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("relay", help="relay attention vs per-request reads of a shared system prompt")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device to time on (cpu: a smoke run on tiny shapes, torch references for the op)")
    p.add_argument("--out", default=None, help="output folder (default bench-results/relay-DEVICE)")
    p.add_argument("--shapes", type=choice_list(SHAPES), default=None,
                   help="comma-separated shapes (cuda default: llama-2-7b,mistral-7b; cpu: tiny-llama)")
    p.add_argument("--systems", type=int_list, default=[512, 1024, 2048, 4096, 8192], help="op: system lengths")
    p.add_argument("--contexts", type=int_list, default=[128, 256], help="op: context lengths")
    p.add_argument("--batches", type=int_list, default=[4, 8, 16, 32, 64], help="op: batch sizes")
    p.add_argument("--e2e-systems", type=int_list, default=[1024, 2048], help="end to end: system lengths")
    p.add_argument("--e2e-shapes", type=choice_list(SHAPES), default=None,
                   help="end to end: comma-separated shapes (default: --shapes)")
    p.add_argument("--requests", type=positive_int, default=64, help="end to end: requests per round")
    p.add_argument("--concurrency", type=positive_int, default=64, help="end to end: most sequences run at once")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="end to end: rounds of the modes, interleaved; rows give the median round")
    p.add_argument("--max-prompt", type=positive_int, default=512,
                   help="end to end: cap on a request's own prompt tokens (after the system prompt)")
    p.add_argument("--max-output", type=positive_int, default=128, help="end to end: cap on a request's output tokens")
    p.add_argument("--data", default=SHAREGPT,
                   help="end to end: ShareGPT JSONL giving request and answer lengths (default: the bundled dev set)")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end part (time the attention op only)")
    p.add_argument("--skip-op", action="store_true", help="skip the attention-op part (run end to end only)")
    p.set_defaults(func=run)


def theoretical_speedup(s: int, c: int, b: int, g: int) -> float:
    """RelayAttention's IO-count speedup (the paper's eq. 10, with g query heads per KV head)."""
    return (s + c + 2 * g) / (s / b + c + 7 * g)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    return wall


def copy_bandwidth(timer: Callable[[Callable[[], Any]], float], device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy, read + write: the floor's yardstick."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (timer(lambda: dst.copy_(src)) * 1e-3)


def rotations(working_set: int, device: torch.device) -> int:
    """Copies of a case's data to cycle through so that each call finds its K/V out of the L2 cache,
    as a layer's attention does in a real decode step (31 other layers' weights and KV passed
    through the cache since its last call): at least three L2 sizes between two uses of one copy."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(8, math.ceil(3 * l2 / max(1, working_set))))


class OpCase:
    """One decode step's attention (one layer) on one set of cache data: every request's own ``c``
    tokens after one system prompt of ``s`` tokens.

    paged: our paged decode kernel (the engine's) over [shared system blocks + own blocks];
    paged_copies: the same kernel over a copy of the system blocks per request (the paper's baseline,
    no prefix sharing); relay: system part once per batch + context per request + fused reduction.
    The shared-block baseline reads the same system blocks for every request, so the GPU's L2 cache
    serves part of those reads. All read the same K/V values."""

    def __init__(self, heads: int, kvh: int, d: int, s: int, c: int, b: int, device: torch.device,
                 dtype: torch.dtype, copies: bool, tile_rows: int | None = None) -> None:
        page = 16
        self.s, self.c, self.b, self.kvh, self.d = s, c, b, kvh, d
        sys_blocks, own_blocks = -(-s // page), -(-c // page)
        blocks = sys_blocks + b * own_blocks
        self.k = torch.randn(blocks, page, kvh, d, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)
        perm = torch.randperm(blocks, device=device, dtype=torch.int32)
        sys_table = perm[:sys_blocks]
        self.own = perm[sys_blocks:].view(b, own_blocks)
        self.q = torch.randn(b, heads, d, device=device, dtype=dtype)
        self.scale = d**-0.5
        self.full_tables = torch.cat([sys_table.expand(b, -1), self.own], dim=1).contiguous()  # s: whole pages
        self.full_lens = torch.full((b,), s + c, dtype=torch.int32, device=device)
        self.own_lens = torch.full((b,), c, dtype=torch.int32, device=device)
        if copies:
            block_ids = torch.arange(b * sys_blocks, device=device, dtype=torch.int32).view(b, sys_blocks) + blocks
            self.copy_tables = torch.cat([block_ids, self.own], dim=1).contiguous()
            self.k_copies = torch.cat([self.k, self.k[sys_table.long()].repeat(b, 1, 1, 1)])
            self.v_copies = torch.cat([self.v, self.v[sys_table.long()].repeat(b, 1, 1, 1)])
        self.sys_table, self.group = sys_table, heads // kvh
        self.relay_meta = self.relay_metadata(tile_rows)

    def relay_metadata(self, tile_rows: int | None = None) -> Any:
        """The batch's relay metadata, with system tiles of ``tile_rows`` query rows (default: the engine's)."""
        from ragfuse.engine.attention import RelayMetadata
        from ragfuse.kernels.relay import TILE_ROWS, tile_tokens_for

        return RelayMetadata.build([0] * self.b, tile_tokens_for(self.group, tile_rows or TILE_ROWS),
                                   self.sys_table[None].contiguous(),
                                   torch.tensor([self.s], dtype=torch.int32, device=self.q.device), self.s,
                                   self.q.device)

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kvh * self.d * 2 * self.k.element_size()

    @property
    def relay_bytes(self) -> int:
        """Bytes relay must read: the system K/V once, each request's own K/V."""
        return self.kv_bytes(self.s + self.b * self.c)

    @property
    def paged_bytes(self) -> int:
        """Bytes the paged kernel asks for: the system K/V once per request, plus its own."""
        return self.kv_bytes(self.b * (self.s + self.c))

    def reference(self) -> Any:
        from ragfuse.kernels.merge import merge_attention_ref
        from ragfuse.kernels.paged_attention import paged_decode_attention_ref
        from ragfuse.kernels.relay import system_attention_ref

        m = self.relay_meta
        sys = system_attention_ref(self.q, self.k, self.v, m.sys_tables, m.sys_lens, m.token_system, self.scale)
        return merge_attention_ref(
            *sys, *paged_decode_attention_ref(self.q, self.k, self.v, self.own, self.own_lens, self.scale))

    def paged(self, num_splits: int | None = None) -> Any:
        if self.q.device.type != "cuda":
            from ragfuse.kernels.paged_attention import paged_decode_attention_ref

            return paged_decode_attention_ref(self.q, self.k, self.v, self.full_tables, self.full_lens, self.scale)
        from ragfuse.kernels.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(self.q, self.k, self.v, self.full_tables, self.full_lens, self.scale,
                                             max_seq_len=self.s + self.c, num_splits=num_splits)

    def paged_copies(self) -> Any:
        if self.q.device.type != "cuda":
            from ragfuse.kernels.paged_attention import paged_decode_attention_ref

            return paged_decode_attention_ref(self.q, self.k_copies, self.v_copies, self.copy_tables, self.full_lens,
                                              self.scale)
        from ragfuse.kernels.paged_attention_triton import paged_decode_attention_triton

        return paged_decode_attention_triton(self.q, self.k_copies, self.v_copies, self.copy_tables, self.full_lens,
                                             self.scale, max_seq_len=self.s + self.c)

    def relay(self, **options: Any) -> Any:
        """Relay decode; ``options`` go to ``relay_decode_attention_triton`` (splits, tuning)."""
        if self.q.device.type != "cuda":
            return self.reference()
        from ragfuse.kernels.relay_triton import relay_decode_attention_triton

        m = self.relay_meta
        return relay_decode_attention_triton(self.q, self.k, self.v, self.own, self.own_lens, m.sys_tables,
                                             m.sys_lens, m.tile_tokens, m.tile_system, self.scale, self.c, self.s,
                                             **options)


def cases(heads: int, kvh: int, d: int, s: int, c: int, b: int, device: torch.device,
          dtype: torch.dtype) -> tuple[list[OpCase], list[OpCase]]:
    """(cases for the paged-shared and relay timings, cases holding per-request copies): as many data
    copies as ``rotations`` asks for each, so every call starts with a cold L2 cache."""
    one = OpCase(heads, kvh, d, s, c, b, device, dtype, copies=True)
    shared = [one] + [OpCase(heads, kvh, d, s, c, b, device, dtype, copies=False)
                      for _ in range(rotations(one.relay_bytes, device) - 1)]
    with_copies = [one] + [OpCase(heads, kvh, d, s, c, b, device, dtype, copies=True)
                           for _ in range(rotations(one.paged_bytes, device) - 1)]
    return shared, with_copies


def cycling(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """A call that runs the next of ``fns`` each time (captured into one graph, each keeps its data)."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def rel_err(got: Any, want: Any) -> float:
    return float((got[0].float() - want[0].float()).norm() / want[0].float().norm())


def bench_op(args: argparse.Namespace, shape: str, cfg: dict[str, Any], device: torch.device,
             bandwidth: float | None, rows: list[dict[str, Any]]) -> None:
    """The op rows of ``shape``, each appended to ``rows`` as soon as it is measured."""
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = _timer(device)
    combos = [(s, c, b) for s in args.systems for c in args.contexts for b in args.batches]
    for s, c, b in tqdm(combos, desc=f"relay op {shape}"):
        shared, with_copies = cases(heads, kvh, d, s, c, b, device, dtype)
        one = shared[0]
        want = one.reference()
        err, err_base = rel_err(one.relay(), want), rel_err(one.paged_copies(), want)
        t_paged = timer(cycling([x.paged for x in shared]))
        t_copies = timer(cycling([x.paged_copies for x in with_copies]))
        t_relay = timer(cycling([x.relay for x in shared]))
        p = theoretical_speedup(s, c, b, heads // kvh)
        rows.append({
            "part": "op", "shape": shape, "heads": f"{heads}q/{kvh}kv", "system": s, "context": c, "batch": b,
            "paged_shared_ms": t_paged, "paged_copies_ms": t_copies, "relay_ms": t_relay,
            # relay's bytes at the faster of the copy rate and the rate the paged kernel read the copies at
            "relay_floor_ms": one.relay_bytes / max(bandwidth, one.paged_bytes / t_copies * 1e3) * 1e3
            if bandwidth else None,
            "speedup": t_paged / t_relay, "speedup_vs_copies": t_copies / t_relay, "theoretical": p,
            "of_theoretical": t_paged / t_relay / p, "copies_of_theoretical": t_copies / t_relay / p,
            "rel_err": err, "rel_err_paged": err_base,
        })
        del shared, with_copies, one


def workload(path: str, n: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the first ``n`` ShareGPT conversations' first turns. A file
    that is not ShareGPT JSONL is a RagfuseError naming the line."""
    from ragfuse.engine import RagfuseError

    out: list[tuple[int, int]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    turns = json.loads(line)["conversations"]
                    if len(turns) < 2 or turns[0]["from"] != "human" or not turns[0]["value"].strip():
                        continue
                    prompt = min(max_prompt, max(4, len(turns[0]["value"]) // 4))
                    answer = min(max_output, max(4, len(turns[1]["value"]) // 4))
                except (ValueError, LookupError, TypeError, AttributeError) as exc:
                    raise RagfuseError(f"{path}:{number}: not a ShareGPT conversation ({exc!r})") from exc
                out.append((prompt, answer))
                if len(out) == n:
                    break
    except UnicodeDecodeError as exc:
        raise RagfuseError(f"{path}: not UTF-8 text") from exc
    except OSError as exc:
        raise RagfuseError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not out:
        raise RagfuseError(f"{path}: no usable conversations")
    while len(out) < n:  # a short file: cycle through it
        out.append(out[len(out) % len(out)])
    return out


def run_mode(eng: Any, mode: str, system: list[int], sid: int, reqs: list[list[int]], outs: list[int],
             sync: Callable[[], None]) -> tuple[float, int]:
    """Run every request to its length; returns (seconds, output tokens)."""
    from ragfuse.engine import SamplingParams

    sync()
    t = time.perf_counter()
    for prompt, n in zip(reqs, outs):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        if mode == "none":
            eng.add_request(system + prompt, params)
        else:
            eng.add_request(prompt, params, system=sid, relay=mode == "relay")
    produced = 0
    while eng.has_unfinished():
        produced += sum(len(o.delta_token_ids) for o in eng.step())
    sync()
    return time.perf_counter() - t, produced


def e2e_setup(
    cfg: dict[str, Any], device: torch.device, max_system: int, requests: int, concurrency: int, max_prompt: int,
    max_output: int, data: str,
) -> tuple[Any, list[list[int]], list[int], torch.Generator]:
    """The end-to-end runs' engine (random weights of shape ``cfg``, ``concurrency`` sequences at once),
    the requests' prompts (random tokens of ShareGPT lengths) and answer lengths, and the generator the
    system prompts are drawn from next (the same draws in every process, for A/B runs)."""
    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

    cfg = dict(cfg)
    need = max_system + max_prompt + max_output + 16
    cfg["max_position_embeddings"] = max(min(cfg["max_position_embeddings"], 32768), need)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    # no prefix tree: it would find the system prompt cached by the warm-up and share it in "none" mode too
    eng = LLMEngine(EngineConfig(device=device.type, dtype=dtype, max_num_seqs=concurrency, max_model_len=need,
                                 prefix_tree=False), random_weights=ModelConfig.from_dict(cfg))
    g = torch.Generator().manual_seed(0)
    lens = workload(data, requests, max_prompt, max_output)
    reqs = [torch.randint(3, cfg["vocab_size"], (p,), generator=g).tolist() for p, _ in lens]
    return eng, reqs, [o for _, o in lens], g


@dataclass
class AbRun:
    """An engine behind one registered system prompt, for the A/B scripts (``scripts/ab_*.py``)."""

    eng: Any
    system: list[int]
    sid: int
    reqs: list[list[int]]
    outs: list[int]

    def time(self, mode: str) -> tuple[float, int]:
        """(seconds, output tokens) of every request in ``mode`` ("shared" or "relay")."""
        return run_mode(self.eng, mode, self.system, self.sid, self.reqs, self.outs, _sync(self.eng))


def _sync(eng: Any) -> Callable[[], None]:
    return torch.cuda.synchronize if eng.runner.device.type == "cuda" else (lambda: None)


def ab_setup(shape: str, device: torch.device, system_len: int, requests: int, data: str) -> AbRun:
    """``e2e_setup`` (up to 64 requests at once, prompts to 512 tokens, answers to 128) with a system
    prompt of ``system_len`` random tokens registered (which captures the relay graphs: set relay's
    launch choices before) and both sharing modes run once on two-token answers (kernels compiled)."""
    cfg = shape_config(shape)
    eng, reqs, outs, g = e2e_setup(cfg, device, system_len, requests, 64, 512, 128, data)
    system = torch.randint(3, cfg["vocab_size"], (system_len,), generator=g).tolist()
    run = AbRun(eng, system, eng.register_system(system), reqs, outs)
    for mode in ("shared", "relay"):
        run_mode(eng, mode, system, run.sid, reqs, [2] * len(reqs), _sync(eng))
    return run


def bench_e2e(args: argparse.Namespace, shape: str, cfg: dict[str, Any], device: torch.device,
              rows: list[dict[str, Any]]) -> None:
    """The end-to-end rows of ``shape``, each system length's appended to ``rows`` once its modes ran."""
    eng, reqs, outs, g = e2e_setup(cfg, device, max(args.e2e_systems), args.requests, args.concurrency,
                                   args.max_prompt, args.max_output, args.data)
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    vocab = cfg["vocab_size"]
    for s in args.e2e_systems:
        system = torch.randint(3, vocab, (s,), generator=g).tolist()
        sid = eng.register_system(system)
        for mode in MODES:  # warm-up on the same prompts: kernels compiled before the clock runs
            run_mode(eng, mode, system, sid, reqs, [2] * len(reqs), sync)
        # rounds interleave the modes, so a drift of the machine (clocks, heat) touches each alike
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        produced: dict[str, int] = {}
        for _, mode in tqdm(list(itertools.product(range(args.repeats), MODES)), desc=f"relay e2e {shape} s={s}"):
            secs, produced[mode] = run_mode(eng, mode, system, sid, reqs, outs, sync)
            runs[mode].append(secs)
        timed = {}
        done = []
        for mode in MODES:
            secs = statistics.median(runs[mode])
            timed[mode] = produced[mode] / secs
            done.append({"part": "e2e", "shape": shape, "system": s, "mode": mode, "requests": len(reqs),
                         "output_tokens": produced[mode], "seconds": secs, "tok_s": timed[mode],
                         "runs_s": [round(x, 4) for x in runs[mode]]})
        rows += [*done, {"part": "e2e", "shape": shape, "system": s, "mode": "relay speedup",
                         "vs_none": timed["relay"] / timed["none"], "vs_shared": timed["relay"] / timed["shared"]}]
        eng.release_system(sid)
    del eng
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    if args.skip_op and args.skip_e2e:
        raise RagfuseError("--skip-op and --skip-e2e together leave nothing to measure")
    device = torch.device(args.device)
    # the 7B shapes' end-to-end engines hold their random weights in float32 on a CPU (28 GB and more):
    # the default there is the tiny shape, as in the other benchmarks
    shapes = args.shapes or (["llama-2-7b", "mistral-7b"] if device.type == "cuda" else ["tiny-llama"])
    configs = {name: shape_config(name) for name in shapes}
    e2e_shapes = args.e2e_shapes or shapes
    unknown = [x for x in e2e_shapes if x not in configs]
    if unknown:
        raise RagfuseError(f"--e2e-shapes {','.join(unknown)}: not among --shapes")
    if not args.skip_e2e:
        if not Path(args.data).is_file():
            raise RagfuseError(f"--data {args.data}: no such file")
        workload(args.data, args.requests, args.max_prompt, args.max_output)  # a bad file fails before the op part
    bad = [s for s in args.systems if s % 16]
    if bad:
        raise RagfuseError(f"--systems must be multiples of 16 (the page), got {bad}")
    torch.manual_seed(0)
    results = {"benchmark": "relay", "machine": machine_info(str(device)), "shapes": shapes,
               "goals": {"op": "speedup >= 0.9 p at b=32, s=2048, c=128 (of_theoretical, copies_of_theoretical)",
                         "e2e": "s=2048: llama-2-7b relay >= 2.2x none and >= 1.5x shared; mistral-7b >= 1.3x shared"}}
    bandwidth = copy_bandwidth(_timer(device), device) if device.type == "cuda" and not args.skip_op else None
    if bandwidth:
        results["copy_bandwidth_gbs"] = round(bandwidth / 1e9, 1)
    notes = (
        f"Device: {results['machine'].get('gpu', device)}. Op rows: one decode step's attention (one layer), "
        "medians of CUDA-graph replays with the K/V out of L2 at every call (data copies cycled, as in a real "
        "step where the other layers' weights pass through the cache between two calls of a layer); "
        "paged_shared = our paged decode kernel (the engine's) reading the shared system blocks per request "
        "(L2 serves part of those reads within a call); paged_copies = the same kernel over a copy of the system "
        "KV per request (the paper's baseline); relay = system part once per batch + context per request + one "
        "fused reduction; relay_floor = relay's bytes (system K/V once + each request's own) at the faster of the "
        f"copy bandwidth ({results.get('copy_bandwidth_gbs', '-')} GB/s, read + write) and the rate the paged kernel "
        "read the per-request copies at; theoretical = (s+c+2g)/(s/b+c+7g). "
        f"E2E rows: output tokens/s, random-weight models, ShareGPT first-turn lengths, {args.requests} requests "
        f"(up to {args.concurrency} at once), the median of {args.repeats} rounds of the modes, interleaved (runs_s)."
    )
    e2e = [] if args.skip_e2e else e2e_shapes
    report = Report(args.out or f"bench-results/relay-{args.device}", "ragfuse bench relay", results,
                    [f"op {x}" for x in ([] if args.skip_op else configs)] + [f"e2e {x}" for x in e2e],
                    plot=lambda fig: _plot(fig, report.rows), notes=notes)
    with report.interruptible():
        if not args.skip_op:
            for name, cfg in configs.items():
                report.begin(f"op {name}")
                bench_op(args, name, cfg, device, bandwidth, report.rows)
            report.write()  # written after each part, so a later part's failure keeps the earlier figures
        for name in e2e:
            report.begin(f"e2e {name}")
            bench_e2e(args, name, configs[name], device, report.rows)
            report.write()
    print((Path(report.out) / "results.md").read_text())
    return 0


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    ax1, ax2 = fig.subplots(1, 2)
    ops = [r for r in rows if r["part"] == "op"]
    for shape in dict.fromkeys(r["shape"] for r in ops):
        pick = [r for r in ops if r["shape"] == shape and r["context"] == min(x["context"] for x in ops)]
        batch = max(b for b in {r["batch"] for r in pick} if b <= 32)
        pick = sorted((r for r in pick if r["batch"] == batch), key=lambda r: r["system"])
        line = ax1.plot([r["system"] for r in pick], [r["speedup_vs_copies"] for r in pick], "o-",
                        label=f"{shape} vs paged, per-request copies")
        ax1.plot([r["system"] for r in pick], [r["speedup"] for r in pick], "s:", color=line[0].get_color(),
                 label=f"{shape} vs paged, shared blocks")
        ax1.plot([r["system"] for r in pick], [r["theoretical"] for r in pick], "--", color=line[0].get_color(),
                 label=f"{shape} theoretical")
        ax1.set_title(f"attention op, decode, b={batch}, c={pick[0]['context'] if pick else ''}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("system prompt tokens")
    ax1.set_ylabel("relay speedup over paged decode")
    ax1.legend(fontsize=7)
    e2e = [r for r in rows if r["part"] == "e2e" and r["mode"] == "relay speedup"]
    for shape in dict.fromkeys(r["shape"] for r in e2e):
        pick = sorted((r for r in e2e if r["shape"] == shape), key=lambda r: r["system"])
        ax2.plot([r["system"] for r in pick], [r["vs_none"] for r in pick], "o-", label=f"{shape} vs no sharing")
        ax2.plot([r["system"] for r in pick], [r["vs_shared"] for r in pick], "s--", label=f"{shape} vs prefix-shared")
    ax2.set_xlabel("system prompt tokens")
    ax2.set_ylabel("relay speedup, output tokens/s")
    ax2.set_title("end to end")
    if e2e:
        ax2.legend(fontsize=7)
    else:  # no end-to-end speedup rows in this run
        ax2.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax2.transAxes)
