"""``ragfuse eval qa``: quality and TTFT of the fusion modes against full prefill."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ragfuse.commands.generate import add_model_args, positive_int, unit_ratio
from ragfuse.store_dir import CHUNK_KV_CONTEXTS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="quality evaluations")
    esub = p.add_subparsers(dest="eval", required=True, parser_class=type(p))
    q = esub.add_parser("qa", help="fusion modes vs full prefill on CacheBlend-format QA data")
    q.add_argument("--dataset", required=True, help="JSON list (or JSON Lines) of {ctxs, question, answers}")
    q.add_argument("--limit", type=positive_int, default=None, help="first N examples")
    q.add_argument("--max-passages", type=positive_int, default=6, help="passages per example (default 6)")
    q.add_argument("--modes", default="full,prefix,reuse,fuse,fuse-paper",
                   help="comma-separated: full, prefix, reuse, fuse (ragfuse's selection), fuse-paper "
                        "(the paper's one-check-layer V-deviation selection), full-bf16kv (full prefill's KV "
                        "rounded to bfloat16 and reused: the measures' noise floor), and LangChain's chains mapreduce, "
                        "maprerank (each passage alone, then combined / best-scored answer)")
    q.add_argument("--recompute-ratio", type=unit_ratio, default=0.15,
                   help="share of stored tokens the fuse modes recompute, 0 to 1 (default 0.15)")
    q.add_argument("--sweep", action="store_true", help="also sweep ratios 0-100%% for fuse and fuse-paper")
    q.add_argument("--sweep-modes", default=None,
                   help="selections swept (comma-separated; default fuse,fuse-paper; needs --sweep)")
    q.add_argument("--sweep-limit", type=positive_int, default=None,
                   help="examples in the sweep (default: all; needs --sweep)")
    q.add_argument("--max-tokens", type=positive_int, default=16, help="greedy answer length")
    q.add_argument("--chunk-kv-context", choices=CHUNK_KV_CONTEXTS, default="instruction",
                   help="passages' stored KV computed after the instruction prefix (as ingest stores it by "
                        "default) or alone (as CacheBlend stores it)")
    add_model_args(q)
    add_policy_args(q)
    q.add_argument("--out", default=None,
                   help="write results.json and results.md here (with --sweep also results.png, the sweep's plot)")
    q.add_argument("--json", action="store_true",
                   help="print the report as one JSON object instead of tables (modes, settings, cases; "
                        "sweep with --sweep)")
    q.set_defaults(func=run_qa)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """Knobs of ragfuse's own selection (``fuse``). Unset ones keep the shipped policy's values,
    filled in by ``policy_from_args``: reading them here would load the engine (torch) just to parse."""
    p.add_argument("--metric", choices=["k", "v", "kv"],
                   help="which deviation ranks tokens for recompute: K, V or both (default: the policy's)")
    p.add_argument("--check-layers", help="comma-separated layer indices")
    p.add_argument("--first-factor", type=float,
                   help="the first check layer keeps this times the ratio, narrowing to the ratio at the last "
                        "(at least 1; default: the policy's)")
    p.add_argument("--sink-tokens", type=int,
                   help="first tokens of every stored segment always recomputed (default: the policy's)")
    p.add_argument("--tail-tokens", type=int,
                   help="last tokens of the stored passage nearest the question always recomputed (default: the "
                        "policy's)")
    p.add_argument("--attention-weight", type=float,
                   help="rank by deviation * (the question's attention to the token) ** this (0: deviation alone)")
    p.add_argument("--revert-dropped", action=argparse.BooleanOptionalAction,
                   help="a check layer restores the stored KV of the candidates it drops (ratio 0 = reuse)")
    p.add_argument("--stale-shift", type=float,
                   help="share of its segment's mean fresh-minus-stored deviation added to each stale token's KV")
    p.add_argument("--stale-shift-k", type=float,
                   help="K's own share of that shift (default: the policy's; unset, the same as --stale-shift)")
    p.add_argument("--k-mass-cap", type=float,
                   help="nats the K shift may move the question's attention mass on a passage, per layer and KV "
                        "head (0: no cap; default: the policy's)")


POLICY_ARGS = ("metric", "check_layers", "first_factor", "sink_tokens", "tail_tokens", "attention_weight",
               "revert_dropped", "stale_shift", "stale_shift_k", "k_mass_cap")


def policy_from_args(args: argparse.Namespace, ratio: float, num_layers: int | None = None) -> Any:
    """The shipped policy at ``ratio`` with the knobs given on the command line. Knobs that the
    selection would take without complaint yet turn into another ratio than asked are refused: a
    negative ``--sink-tokens`` (a negative slice recomputes nearly everything), a ``--first-factor``
    below 1 (the funnel would end below r), a negative or NaN ``--attention-weight``, and, given the
    model's ``num_layers``, a check layer it does not have (the funnel never reaches its last
    check, so 3r is recomputed instead of r)."""
    import math
    from dataclasses import replace

    from ragfuse.engine import RagfuseError
    from ragfuse.engine.fusion import SelectionPolicy

    given = {name: getattr(args, name) for name in POLICY_ARGS if getattr(args, name) is not None}
    try:
        if "check_layers" in given:
            given["check_layers"] = tuple(int(x) for x in given["check_layers"].split(",") if x.strip())
        policy = replace(SelectionPolicy.default(), ratio=ratio, **given)
        for name in ("sink_tokens", "tail_tokens"):
            if getattr(policy, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(policy, name)}")
        if not policy.first_factor >= 1.0 or math.isinf(policy.first_factor):
            raise ValueError(f"--first-factor must be a finite number of at least 1, got {policy.first_factor}")
        if not policy.attention_weight >= 0.0 or math.isinf(policy.attention_weight):
            raise ValueError(f"--attention-weight must be a finite number of at least 0, got {policy.attention_weight}")
        if num_layers is not None and max(policy.check_layers) >= num_layers:
            raise ValueError(f"check layers must be below the model's {num_layers} layers, got "
                             f"{','.join(map(str, policy.check_layers))}")
        return policy
    except ValueError as exc:
        raise RagfuseError(f"bad selection policy: {exc}") from exc


def run_qa(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from tqdm.auto import tqdm

    from ragfuse.bench.report import json_safe, prepare_out_dir
    from ragfuse.engine import EngineConfig, LLMEngine, RagfuseError
    from ragfuse.eval_qa import BASELINE_MODES, FUSION_MODES, NOISE_MODE, SWEEP, evaluate, load_dataset, parse_modes

    # everything a user typed is checked before the model loads and the cases run: a bad mode, a
    # dataset or an --out that cannot be written found afterwards would cost the whole run
    modes = parse_modes(args.modes, (*FUSION_MODES, NOISE_MODE, *BASELINE_MODES))
    for name in ("sweep_modes", "sweep_limit"):  # a sweep's setting without the sweep would be ignored
        if getattr(args, name) is not None and not args.sweep:
            raise RagfuseError(f"--{name.replace('_', '-')} needs --sweep")
    sweep_modes = parse_modes(args.sweep_modes or "fuse,fuse-paper", FUSION_MODES) if args.sweep else []
    if not modes and not sweep_modes:
        raise RagfuseError("--modes names no mode")
    examples = load_dataset(args.dataset, args.limit, args.max_passages)
    policy_from_args(args, args.recompute_ratio)
    if args.out:
        prepare_out_dir(args.out)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    policy = policy_from_args(args, args.recompute_ratio, engine.model_config.num_layers)
    # the sweep on the same examples runs in the same pass: each case's full prefill is made once
    # and the sweep's point at the main ratio is the main fuse rows' run
    one_pass = args.sweep and (args.sweep_limit or len(examples)) >= len(examples)
    with tqdm(total=len(examples), desc="eval qa") as bar:
        main = evaluate(engine, examples, modes, args.recompute_ratio, policy, sweep=SWEEP if one_pass else (),
                        sweep_modes=sweep_modes, max_tokens=args.max_tokens, progress=bar,
                        kv_context=args.chunk_kv_context)
    report: dict[str, Any] = {
        "modes": {k: v for k, v in main["modes"].items() if "@" not in k},
        "settings": {"dataset": args.dataset, "examples": len(examples), "max_passages": args.max_passages,
                     "recompute_ratio": args.recompute_ratio, "policy": asdict(policy), "model": engine.model_name,
                     "device": str(engine.device), "max_tokens": args.max_tokens,
                     "chunk_kv_context": args.chunk_kv_context},
        "elapsed_s": main["elapsed_s"],
        "cases": main["cases"],
    }
    if main["interrupted"]:  # Ctrl-C: report the cases that finished, marked as such, and stop there
        report["settings"]["examples"] = len(main["cases"])
        report["interrupted"] = f"stopped by the user after {len(main['cases'])} of {len(examples)} examples"
        print(f"ragfuse: {report['interrupted']}; their figures follow", file=sys.stderr, flush=True)
    if one_pass:
        report["sweep"] = {k: v for k, v in main["modes"].items() if "@" in k or k == "reuse"}
        report["settings"]["sweep_examples"] = len(main["cases"])
    elif args.sweep and not main["interrupted"]:
        sweep_examples = examples[: args.sweep_limit] if args.sweep_limit else examples
        with tqdm(total=len(sweep_examples), desc="eval qa sweep") as bar:
            sw = evaluate(engine, sweep_examples, ["reuse"], args.recompute_ratio, policy, sweep=SWEEP,
                          sweep_modes=sweep_modes, max_tokens=args.max_tokens, progress=bar,
                          kv_context=args.chunk_kv_context)
        report["sweep"] = sw["modes"]
        report["settings"]["sweep_examples"] = len(sweep_examples)
    # printed before the files are written: should the write fail after all (a disk that filled up
    # meanwhile), the run's figures are still on the screen
    if args.json:
        print(json.dumps(json_safe(report), allow_nan=False), flush=True)
    else:
        from ragfuse.bench.report import markdown_table

        print(markdown_table([{"mode": k, **v} for k, v in report["modes"].items()]))
        if "sweep" in report:
            print(markdown_table([{"point": k, **v} for k, v in report["sweep"].items()]), flush=True)
    if args.out:
        _write(args.out, report)
    return 130 if main["interrupted"] else 0


def _write(out: str, report: dict[str, Any]) -> None:
    from ragfuse.bench.report import write_report

    rows = [{"mode": k, **v} for k, v in report["modes"].items()]
    sweep = report.get("sweep", {})
    rows += [{"mode": k, **v} for k, v in sweep.items() if "@" in k]

    def plot(fig: Any) -> None:
        ax1, ax2, ax3 = fig.subplots(1, 3)
        for name in ("fuse", "fuse-paper"):
            pts = sorted((float(k.split("@")[1]), v) for k, v in sweep.items() if k.startswith(f"{name}@"))
            if not pts:
                continue
            xs = [100 * x for x, _ in pts]
            ax1.plot(xs, [v["kl_tf"] for _, v in pts], marker="o", label=name)
            ax2.plot(xs, [v["f1_full"] for _, v in pts], marker="o", label=name)
            ax3.plot(xs, [v["ttft_s"] for _, v in pts], marker="o", label=name)
        for ax, label in ((ax1, "kl_tf vs full (lower is better)"), (ax2, "f1 vs full's answer"),
                          (ax3, "TTFT s")):
            ax.set_xlabel("recompute ratio %")
            ax.set_title(label)
            ax.legend()

    write_report(out, "ragfuse eval qa", report, rows, plot if sweep else None,
                 notes=json.dumps(report["settings"]))
