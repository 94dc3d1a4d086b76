"""The QA evaluation's parts: dataset formats, answer normalisation, F1, and a real run."""

from __future__ import annotations

import json
import signal

import pytest

from ragfuse.engine import RagfuseError
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import evaluate, load_dataset, normalize, token_f1


def test_normalize_and_f1_follow_squad():
    assert normalize("The  Eiffel Tower!") == "eiffel tower"
    assert token_f1("the Eiffel tower", "Eiffel Tower") == 1.0
    assert token_f1("Paris", "London") == 0.0
    assert abs(token_f1("new york city", "new york") - 0.8) < 1e-9


def test_dataset_answers_may_be_lists_of_aliases(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([
        {"ctxs": [{"title": "A", "text": "a"}, {"title": "B", "text": "b"}], "question": "q1", "answers": ["x", "y"]},
        {"ctxs": [{"title": "C", "text": "c"}], "question": "q2", "answers": [["u", "U"], ["v"]]},
    ]))
    exs = load_dataset(path, limit=None, max_passages=1)
    assert [e.answers for e in exs] == [["x", "y"], ["u", "U", "v"]]
    assert exs[0].passages == ["A\na"]
    path.write_text(json.dumps([{"question": "no contexts"}]))
    with pytest.raises(RagfuseError, match="ctxs"):
        load_dataset(path, None, None)


def test_evaluate_reports_every_mode_against_full(engine, tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{
        "ctxs": [{"title": "Marrow Canal", "text": "The Marrow Canal was designed by Agnes Voll in 1822."},
                 {"title": "Agnes Voll", "text": "Agnes Voll was born in the town of Harrowgate."}],
        "question": "Where was the designer of the Marrow Canal born?", "answers": ["Harrowgate"],
    }]))
    examples = load_dataset(path, None, None)
    res = evaluate(engine, examples, ["full", "reuse", "fuse", "fuse-paper"], 0.5, SelectionPolicy.default(),
                   sweep=[0.0, 1.0], sweep_modes=["fuse"], max_tokens=8)
    modes = res["modes"]
    assert modes["full"]["kl_tf"] < 1e-6 and modes["full"]["agreement"] == 1.0 and modes["full"]["f1_full"] == 1.0
    assert modes["fuse@1"]["kl_tf"] < 1e-4  # ratio 1 is full prefill
    assert modes["reuse"]["kl_tf"] > modes["fuse@1"]["kl_tf"]
    assert modes["reuse"]["gap_closed"] == 0.0
    assert abs(modes["fuse"]["recompute_ratio"] - 0.5) < 0.05
    for m in modes.values():
        assert set(m) >= {"kl_first", "kl_tf", "gap_closed", "agreement", "f1_full", "f1", "ttft_s", "n"}
    with pytest.raises(RagfuseError, match="no eval mode"):
        evaluate(engine, examples, [], 0.5, SelectionPolicy.default())
    (case,) = res["cases"]  # each case keeps every mode's answer and distances, to inspect or re-slice
    assert case["full_answer"] == case["modes"]["full"]["answer"] and case["gold"] == ["Harrowgate"]
    assert case["modes"]["reuse"]["kl_tf"] == modes["reuse"]["kl_tf"]


def test_passage_kv_after_the_instruction_is_exact_first_and_closer_than_alone(engine):
    """Stored after the instruction prefix (the default chunk KV context), a passage that follows
    the prefix in the prompt has exactly full prefill's KV there: full reuse of a one-passage prompt
    is full prefill. Stored alone (CacheBlend's way) it is not; with several passages the stored
    KV after the prefix is still closer to full prefill's than alone."""
    from ragfuse.prompt import RagPromptBuilder
    from ragfuse.quality import build_case, mode_kl

    builder = RagPromptBuilder(engine.tokenizer)
    one = ["The Marrow Canal was designed by Agnes Voll in 1822."]
    two = one + ["Agnes Voll was born in the town of Harrowgate, north of the river."]
    q = "Where was the designer of the Marrow Canal born?"
    kl = {(n, ctx): mode_kl(engine, build_case(engine, builder, ps, q, 6, ctx), "reuse", SelectionPolicy())[1]
          for n, ps in (("one", one), ("two", two)) for ctx in ("instruction", "none")}
    assert kl[("one", "instruction")] < 1e-5 < kl[("one", "none")]
    assert kl[("two", "instruction")] < kl[("two", "none")]


def test_kl_rows_is_never_negative_and_zero_only_for_the_same_distribution():
    import torch

    from ragfuse.quality import kl_rows

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 49152, generator=gen) * 8
    near = ref + torch.randn(64, 49152, generator=gen) * 1e-6  # equal up to rounding: KL's sum can dip below 0
    kl = kl_rows(ref, near)
    assert (kl >= 0).all() and kl.max() < 1e-6
    assert (kl_rows(ref, torch.randn(64, 49152, generator=gen)) > 0.1).all()


def test_noise_floor_mode_is_full_prefill_but_for_the_rounding(engine):
    """``full-bf16kv`` reuses full prefill's own KV: unrounded it is full prefill (KL ~0), rounded to
    bfloat16 it moves the distribution a little, and far less than full KV reuse of stored chunks."""
    from ragfuse.eval_qa import rounded_full_case, run_mode
    from ragfuse.prompt import RagPromptBuilder
    from ragfuse.quality import build_case

    builder = RagPromptBuilder(engine.tokenizer)
    passages = ["The Marrow Canal was designed by Agnes Voll in 1822.",
                "Agnes Voll was born in the town of Harrowgate, north of the river."]
    case = build_case(engine, builder, passages, "Where was the designer of the Marrow Canal born?", 6)
    pol = SelectionPolicy()
    exact = run_mode(engine, rounded_full_case(engine, case, engine.runner.dtype), "reuse", pol, 6)
    rounded = run_mode(engine, rounded_full_case(engine, case), "reuse", pol, 6)
    reuse = run_mode(engine, case, "reuse", pol, 6)
    assert exact["kl_tf"] < 1e-6 and exact["answer_ids"] == case.answer_ids
    assert 0.0 < rounded["kl_tf"] < reuse["kl_tf"]


def test_an_interrupted_evaluation_reports_the_cases_it_finished(engine, tmp_path):
    """Ctrl-C during a long eval (77 minutes for MuSiQue on a 2-core box) used to lose every case.
    A real KeyboardInterrupt is delivered to the main thread while the second case runs: the first
    case's rows come back whole, marked interrupted, and the engine's pages are all free again."""
    import _thread
    import threading

    path = tmp_path / "d.json"
    ex = {"ctxs": [{"title": "Marrow Canal", "text": "The Marrow Canal was designed by Agnes Voll in 1822."}],
          "question": "Who designed the Marrow Canal?", "answers": ["Agnes Voll"]}
    path.write_text(json.dumps([ex] * 3))
    free = engine.blocks.num_free

    class Bar:  # the progress hook tqdm gets: after the first case, Ctrl-C arrives 20 ms into the next
        def set_postfix_str(self, *_args, **_kwargs) -> None:
            pass

        def update(self, _n: int) -> None:
            threading.Timer(0.02, _thread.interrupt_main).start()

    # a suite run as a background job ignores SIGINT, and ``interrupt_main`` then does nothing
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        res = evaluate(engine, load_dataset(path, None, None), ["full", "reuse", "fuse"], 0.5,
                       SelectionPolicy.default(), max_tokens=8, progress=Bar())
    finally:
        signal.signal(signal.SIGINT, handler)
    assert res["interrupted"] is True and len(res["cases"]) == 1
    assert {m: v["n"] for m, v in res["modes"].items()} == {"full": 1, "reuse": 1, "fuse": 1}
    assert engine.blocks.num_free == free
