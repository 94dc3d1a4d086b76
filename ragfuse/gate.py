"""The per-model accuracy gate: the least recompute ratio r* that keeps fusion close to full prefill.

The first time a model is used with fusion, the gate runs a calibration set with full prefill, full KV
reuse and fusion at increasing ratios, and takes as r* the smallest ratio whose
``gap_closed`` (the share of reuse's teacher-forced KL that fusion removes) reaches the target. If
no ratio below 1 does, r* is 1: fusion falls back to full recompute, and the log says so. The
result is cached per model (weights fingerprint) and policy; the loading controller never goes
below it.

The calibration set is a few real multi-chunk RAG prompts like the eval's (6 retrieved passages of
about 600 tokens, multi-hop questions): the last examples of the shared MuSiQue and 2WikiMQA dev
sets, which the eval (their first N examples) never scores, scored over 16 answer tokens as the eval
is. Full reuse's teacher-forced KL on them (0.12 for the default model) is close to the eval's (0.15
MuSiQue, 0.11 2WikiMQA); the short hand-written probes were far easier. Without the shared data the
gate falls back to those probes (``probes.py``) and says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ragfuse.engine import LLMEngine
from ragfuse.engine.atomic_file import write_atomic
from ragfuse.engine.checkpoint import cache_root
from ragfuse.engine.errors import RequestError
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import load_dataset
from ragfuse.probes import PROBES
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import build_case, mode_kl
from ragfuse.shared_data import shared_data

log = logging.getLogger("ragfuse.gate")
RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7)
DEFAULT_TARGET = 0.6
CALIBRATION_DATASETS = ("musique_dev.json", "wikimqa_dev.json")
# mean teacher-forced KL per prompt below which full reuse already matches full prefill up to float
# rounding (a model whose sliding window keeps the answer from ever reading the passages' KV): its
# KL is noise, and so is every ratio's share of it, so fusion has no gap left to close
NOISE_KL = 1e-5
PER_DATASET = 4  # 8 prompts of ~3.7K tokens: about 4 minutes on a 2-core CPU, once per model and policy


@dataclass
class Calibration:
    model: str
    calibration_set: str  # "shared-dev" or "probes"
    policy: dict
    target_gap_closed: float
    r_star: float
    gap_closed: dict[str, float]  # ratio -> gap closed on the probes
    kl_tf_reuse: float
    fallback_to_full: bool
    chunk_kv_context: str  # how the calibration's chunk KV was stored (chunk_kv.py): r* depends on it


def calibration_prompts(per_dataset: int = PER_DATASET) -> tuple[str, list[dict[str, object]]]:
    """(name, prompts): the last ``per_dataset`` examples of each shared dev set with their first 6
    passages, or the built-in probes where the shared data is missing."""
    paths = [shared_data(name) for name in CALIBRATION_DATASETS]
    if not all(p.exists() for p in paths):
        log.warning("shared dev sets not found (%s): calibrating on the short built-in probes instead",
                    ", ".join(map(str, paths)))
        return "probes", PROBES
    prompts = [{"passages": ex.passages, "question": ex.question}
               for p in paths for ex in load_dataset(p, None, 6)[-per_dataset:]]
    return "shared-dev", prompts


def calibrate(
    engine: LLMEngine, policy: SelectionPolicy | None = None, target: float = DEFAULT_TARGET, answer_tokens: int = 16,
    prompts: tuple[str, list[dict[str, object]]] | None = None, kv_context: str = "instruction",
) -> Calibration:
    """r* on ``prompts`` (name, prompts), by default ``calibration_prompts()``, with chunk KV as a
    store with chunk KV context ``kv_context`` holds it."""
    policy = policy or SelectionPolicy.default()
    builder = RagPromptBuilder(engine.tokenizer)
    name, chosen = prompts or calibration_prompts()
    chosen = [_fitted(engine, builder, p, answer_tokens) for p in chosen]
    # minutes on a CPU, and met inside an app's first call (a framework's logging may show nothing):
    # a progress bar on stderr says what the wait is; at most every ratio is tried
    with tqdm(total=len(chosen) * (2 + len(RATIOS)), desc=f"calibrating r* for {engine.model_name}",
              unit="pass") as bar:
        cases = []
        for p in chosen:
            cases.append(build_case(engine, builder, p["passages"], p["question"], answer_tokens,  # type: ignore[arg-type]
                                    kv_context))
            bar.update()
        reuse = _kl_sum(engine, cases, "reuse", policy, bar)
        gaps: dict[str, float] = {}
        r_star = 1.0
        for r in RATIOS:
            kl = _kl_sum(engine, cases, "fuse", policy.with_ratio(r), bar)
            gaps[f"{r:g}"] = 1.0 - kl / reuse if reuse > NOISE_KL * len(cases) else 1.0
            if gaps[f"{r:g}"] >= target:
                r_star = r
                break
        bar.update(bar.total - bar.n)
    fallback = r_star >= 1.0
    if fallback:
        log.warning("fusion does not reach gap_closed %.2f below ratio 1 on %s: falling back to full recompute",
                    target, engine.model_name)
    return Calibration(engine.model_name, name, asdict(policy), target, r_star, gaps, reuse / len(cases), fallback,
                       kv_context)


def _fitted(engine: LLMEngine, builder: RagPromptBuilder, prompt: dict[str, object], answer_tokens: int
            ) -> dict[str, object]:
    """``prompt`` with its last passages dropped until it and its answer fit the model's context.
    The shared dev prompts run ~3.7K tokens: a model of 2K context (TinyLlama's) failed inside
    RoPE on its first fusion, where it should calibrate on what it can read."""
    passages = list(prompt["passages"])  # type: ignore[call-overload]
    question = str(prompt["question"])
    while True:
        n = len(builder.token_ids([builder.passage_tokens(p) for p in passages], question))
        if n + answer_tokens <= engine.max_model_len:
            return {**prompt, "passages": passages}
        if len(passages) <= 1:
            raise RequestError(f"calibration prompt of {n} tokens does not fit the context of {engine.max_model_len}")
        passages.pop()


def gate_cache_path(engine: LLMEngine, policy: SelectionPolicy, target: float, prompts_name: str,
                    kv_context: str) -> Path:
    """Where r* is cached for this model, dtype, selection, calibration set, target and chunk KV context:
    a change of any of them calibrates again instead of reusing an r* measured for something else."""
    # every field but the ratio (which r* replaces) picks the selection, so every one is in the key
    knobs = "-".join(f"{v:g}" if isinstance(v, float) else "_".join(map(str, v)) if isinstance(v, tuple) else str(v)
                     for k, v in asdict(policy).items() if k != "ratio")
    tag = f"{engine.fingerprint}-{str(engine.dtype).removeprefix('torch.')}-{knobs}-{prompts_name}-{target:g}"
    if kv_context != "none":  # stores before the setting held alone chunk KV: their r* keeps its cache file
        tag += f"-after-{kv_context}"
    return cache_root() / "gate" / f"{tag}.json"


def _kl_sum(engine: LLMEngine, cases: list, mode: str, policy: SelectionPolicy, bar: tqdm) -> float:
    """The cases' teacher-forced KL in ``mode``, one step of ``bar`` a case."""
    total = 0.0
    for case in cases:
        total += mode_kl(engine, case, mode, policy)[1]
        bar.update()
    return total


def calibrated_r_star(
    engine: LLMEngine, policy: SelectionPolicy | None = None, target: float = DEFAULT_TARGET,
    prompts: tuple[str, list[dict[str, object]]] | None = None, kv_context: str = "instruction",
) -> float:
    """r* for this model, policy and chunk KV context, from the cache or calibrated now (and cached)."""
    policy = policy or SelectionPolicy.default()
    prompts = prompts or calibration_prompts()
    path = gate_cache_path(engine, policy, target, prompts[0], kv_context)
    if path.exists():
        try:
            return float(json.loads(path.read_text())["r_star"])
        except (ValueError, KeyError, OSError):
            log.warning("unreadable gate cache %s: calibrating again", path)
    log.warning("first use of fusion with %s: calibrating r* on %d %s prompts", engine.model_name,
                len(prompts[1]), prompts[0])
    cal = calibrate(engine, policy, target, prompts=prompts, kv_context=kv_context)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(cal), indent=2))  # another process may calibrate the same at once
    log.warning("r* = %.2f for %s (gap closed per ratio: %s)", cal.r_star, engine.model_name, cal.gap_closed)
    return cal.r_star
