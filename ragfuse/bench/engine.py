"""``ragfuse bench engine``: ragfuse's engine against transformers on the same weights, side by side.

Prefill latency (with MFU against a matmul peak measured in the same run) and decode speed (step
time against the weight-read bound, from a read bandwidth measured in the same run). On CPU the
default model's real weights are used; with ``--shape`` (default on CUDA: mistral-7b) a random-weight
model of that real shape is built once and the same tensors are loaded into both implementations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from .args import int_list, positive_int
from .partial import Report
from .report import machine_info
from .shapes import SHAPES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="prefill and decode speed, ragfuse vs transformers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device both implementations run on (cuda: a 7B shape and longer lengths by default)")
    p.add_argument("--out", default=None, help="output folder (default bench-results/engine-DEVICE)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="real weights (used when --shape is not given)")
    p.add_argument("--shape", default=None, choices=SHAPES,
                   help="random weights of a real shape, e.g. mistral-7b (CUDA default)")
    p.add_argument("--prefill", type=int_list, default=None, help="prompt lengths (cpu: 2048; cuda: 512,1K,4K,8K)")
    p.add_argument("--decode-batches", type=int_list, default=None, help="cpu: 1; cuda: 1,16,64")
    p.add_argument("--context", type=positive_int, default=None, help="decode context length (cpu: 2048; cuda: 1024)")
    p.add_argument("--decode-steps", type=positive_int, default=None, help="timed decode steps (cpu: 32; cuda: 64)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed prefills per prompt length and implementation, the median reported")
    p.set_defaults(func=run)


class Sync:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def median_time(fn: Callable[[], Any], sync: Sync, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak(device: torch.device, sync: Sync) -> tuple[float, str]:
    """FLOP/s of a large square matmul in the dtype the model runs in on that device."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median_time(lambda: a @ b, sync, repeats=10 if device.type == "cuda" else 3, warmup=2)
    return 2 * n**3 / t, f"{n}^3 {str(dtype).removeprefix('torch.')} matmul"


def read_bandwidth(device: torch.device, sync: Sync) -> float:
    """Bytes/s of a read-only pass (a sum) over a buffer larger than every cache: >= 4 GiB on CUDA."""
    nbytes = (4 << 30) + (512 << 20) if device.type == "cuda" else 1 << 30
    x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    t = median_time(lambda: x.sum(), sync, repeats=10 if device.type == "cuda" else 3, warmup=2)
    return nbytes / t


def build_pair(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, str]:
    """(ragfuse engine, transformers model) holding the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragfuse.engine import EngineConfig, LLMEngine, ModelConfig

    if args.shape is None:
        eng = LLMEngine(EngineConfig(model=args.model, device=device.type))
        hf = AutoModelForCausalLM.from_pretrained(str(eng.checkpoint.path), dtype=eng.dtype).to(device).eval()
        return eng, hf, eng.model_name
    from .shapes import shape_config

    cfg = shape_config(args.shape)
    need = (args.context or 1024) + (args.decode_steps or 64) + 8
    cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], max(max(args.prefill or [8192]) + 16, need))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_cfg = AutoConfig.for_model(cfg["architectures"][0].removesuffix("ForCausalLM").lower(), **cfg)
    hf_cfg.torch_dtype = dtype
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa").eval()
    mc = ModelConfig.from_dict(cfg)
    # size the cache for this benchmark alone: the transformers model beside it needs the rest
    tokens = max(max(args.prefill or [8192]), max(args.decode_batches or [64]) * (need + 16))
    kv_bytes = int(mc.kv_bytes_per_token(dtype) * tokens * 1.25)
    eng = LLMEngine(EngineConfig(device=device.type, kv_cache_bytes=kv_bytes, dtype=str(dtype).removeprefix("torch.")),
                    random_weights=mc)
    eng.runner.model.load_weights(hf.state_dict().items())
    return eng, hf, f"random {args.shape}"


def run(args: argparse.Namespace) -> int:
    from ragfuse.engine import RagfuseError, SamplingParams

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RagfuseError("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    if device.type == "cuda" and args.shape is None and args.model == "smollm2-135m-instruct":
        args.shape = "mistral-7b"
    cpu = device.type == "cpu"
    prefill_lens = args.prefill or ([2048] if cpu else [512, 1024, 4096, 8192])
    batches = args.decode_batches or ([1] if cpu else [1, 16, 64])
    context = args.context or (2048 if cpu else 1024)
    steps = args.decode_steps or (32 if cpu else 64)
    out_dir = args.out or f"bench-results/engine-{args.device}"
    sync = Sync(device)
    torch.manual_seed(0)

    print(f"bench engine on {device}: loading both implementations...", flush=True)
    eng, hf, model_name = build_pair(args, device)
    # checked before any timing: a length past the context would fail the run midway, its rows lost
    if max(prefill_lens) > eng.max_model_len or context + steps + 1 > eng.max_model_len:
        raise RagfuseError(f"--prefill up to {max(prefill_lens)} tokens and --context {context} + --decode-steps "
                           f"{steps} must fit the context of {model_name}, {eng.max_model_len} tokens")
    mc = eng.model_config
    peak, peak_what = matmul_peak(device, sync)
    bandwidth = read_bandwidth(device, sync)
    layer_params = sum(p.numel() for n, p in eng.runner.model.named_parameters() if ".layers." in n)
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
    results = {
        "benchmark": "engine", "model": model_name, "dtype": str(eng.dtype), "machine": machine_info(str(device)),
        "matmul_peak_tflops": peak / 1e12, "matmul_peak_measured_by": peak_what,
        "read_bandwidth_gbs": bandwidth / 1e9, "weight_bytes": weight_bytes,
        "attention_backend": getattr(eng.runner, "attention_backend_name", "torch"),
    }
    notes = (
        f"Model: {model_name} ({eng.dtype}) on {results['machine'].get('gpu', device)}. "
        f"Matmul peak {peak / 1e12:.1f} TFLOP/s ({peak_what}); read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(read-only sum); weights {weight_bytes / 1e9:.2f} GB. MFU counts matmul and causal attention FLOPs."
    )
    tasks = [("prefill", n) for n in prefill_lens] + [("decode", b) for b in batches]
    report = Report(out_dir, "ragfuse bench engine", results, [f"{kind} {n}" for kind, n in tasks],
                    plot=lambda fig: _plot(fig, report.rows), notes=notes)
    rows = report.rows
    vocab = mc.vocab_size
    with report.interruptible():
        for kind, n in tqdm(tasks, desc="bench engine"):
            report.begin(f"{kind} {n}")
            if kind == "prefill":
                rows.append(_prefill_row(eng, hf, args.repeats, n, sync, layer_params, peak))
            else:
                prompts = [torch.randint(3, vocab, (context,)).tolist() for _ in range(n)]
                step_ours = decode_step_time(eng, prompts, steps, SamplingParams)
                step_hf = hf_decode_step_time(hf, prompts, steps, device, sync)
                bound = weight_bytes / bandwidth
                rows.append({
                    "phase": "decode", "batch": n, "context": context, "ragfuse_step_ms": step_ours * 1e3,
                    "transformers_step_ms": step_hf * 1e3, "ragfuse_tok_s": n / step_ours,
                    "transformers_tok_s": n / step_hf, "speedup": step_hf / step_ours,
                    "weight_read_bound_ms": bound * 1e3, "ragfuse_over_bound": step_ours / bound,
                })
    path = report.write()
    print((path / "results.md").read_text())
    return 0


def _prefill_row(eng: Any, hf: Any, repeats: int, n: int, sync: Sync, layer_params: int, peak: float
                 ) -> dict[str, Any]:
    """Prefill of ``n`` random tokens, ours and transformers', timed and set against the matmul peak."""
    mc = eng.model_config
    ids = torch.randint(3, mc.vocab_size, (n,)).tolist()
    hf_ids = torch.tensor([ids], device=sync.device)

    def ours() -> None:
        eng.score(ids, last_n=1)

    def theirs() -> None:
        with torch.inference_mode():
            hf(hf_ids, logits_to_keep=1, use_cache=True)

    t_ours = median_time(ours, sync, repeats)
    t_hf = median_time(theirs, sync, repeats)
    flops = 2 * layer_params * n + 2 * mc.num_layers * n * n * mc.num_heads * mc.head_dim
    return {
        "phase": "prefill", "tokens": n, "ragfuse_ms": t_ours * 1e3, "transformers_ms": t_hf * 1e3,
        "speedup": t_hf / t_ours, "ragfuse_mfu": flops / t_ours / peak, "transformers_mfu": flops / t_hf / peak,
    }


def decode_step_time(eng: Any, prompts: list[list[int]], steps: int, params_cls: Any) -> float:
    """Mean time of a decode step once every sequence has finished its prefill."""
    params = params_cls(max_tokens=steps + 1, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    started = 0
    t0 = None
    decode_steps = 0
    while eng.has_unfinished():
        outs = eng.step()
        if t0 is not None:
            decode_steps += 1
        started += sum(1 for o in outs if len(o.token_ids) == 1)
        if t0 is None and started == len(prompts):
            t0 = time.perf_counter()
    assert t0 is not None and decode_steps > 0
    return (time.perf_counter() - t0) / decode_steps


def hf_decode_step_time(hf: Any, prompts: list[list[int]], steps: int, device: torch.device, sync: Sync) -> float:
    """transformers' generate, timed per step: a stopping criterion (called once per generated
    token, after the device has produced it) stamps the clock; the prefill is left out."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            sync()
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
            do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _plot(fig: Any, rows: list[dict[str, Any]]) -> None:
    pre = [r for r in rows if r["phase"] == "prefill"]
    dec = [r for r in rows if r["phase"] == "decode"]
    ax1, ax2 = fig.subplots(1, 2)
    labels = [str(r["tokens"]) for r in pre]
    x = range(len(pre))
    ax1.bar([i - 0.2 for i in x], [r["ragfuse_ms"] for r in pre], 0.4, label="ragfuse")
    ax1.bar([i + 0.2 for i in x], [r["transformers_ms"] for r in pre], 0.4, label="transformers")
    ax1.set_xticks(list(x), labels)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("prefill ms (lower is better)")
    ax1.legend()
    x2 = range(len(dec))
    ax2.bar([i - 0.2 for i in x2], [r["ragfuse_tok_s"] for r in dec], 0.4, label="ragfuse")
    ax2.bar([i + 0.2 for i in x2], [r["transformers_tok_s"] for r in dec], 0.4, label="transformers")
    ax2.set_xticks(list(x2), [f"batch {r['batch']}" for r in dec])
    ax2.set_ylabel("decode output tokens/s (higher is better)")
    ax2.legend()
