"""``ragfuse eval qa`` and ``ragfuse bench``: bad input is one clear line before any work is spent,
figures are valid JSON, and written results are never left half-written."""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from ragfuse.cli import main
from ragfuse.engine import RagfuseError
from ragfuse.engine.fusion import SelectionPolicy
from ragfuse.eval_qa import Example, evaluate, load_dataset, summarize

GOOD = {"ctxs": [{"title": "A", "text": "Paris is in France."}], "question": "Where is Paris?", "answers": ["France"]}


def _dataset(tmp_path: Path, examples: list) -> Path:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(examples))
    return path


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ragfuse: error:")]
    return line


@pytest.mark.parametrize("example, needle", [
    ({**GOOD, "ctxs": ["a plain string passage"]}, "ctxs[0] must be an object"),  # was an AttributeError
    ({**GOOD, "ctxs": []}, "ctxs must be a non-empty list"),  # was run with no passage at all
    ({**GOOD, "answers": []}, "holds no answer"),  # was a ValueError in max() after the whole run
    ({**GOOD, "answers": [[], []]}, "holds no answer"),
    ({**GOOD, "answers": [None]}, "answers must be strings"),  # was the gold answer "None"
    ({**GOOD, "question": None}, "question must be a non-empty string"),  # was the question "None"
    ({**GOOD, "ctxs": [{"title": "A", "text": 7}]}, "ctxs[0] must be an object with a string text"),
])
def test_a_malformed_example_is_refused_when_the_dataset_is_read(tmp_path, example, needle):
    path = _dataset(tmp_path, [GOOD, example])
    assert len(load_dataset(path, 1, None)) == 1  # --limit stops before it: not read, not refused
    with pytest.raises(RagfuseError, match=r"example 1: .*" + needle.replace("[", r"\[").replace("]", r"\]")):
        load_dataset(path, None, None)


def test_answer_shapes_a_user_may_write(tmp_path):
    """A bare string is one answer (it was split into its characters, so F1 scored single letters);
    numbers are their text; a null title is no title (it was the text "None")."""
    path = _dataset(tmp_path, [{**GOOD, "answers": "Paris"}, {**GOOD, "answers": [1990, [2.5, "x"]]},
                               {**GOOD, "ctxs": [{"title": None, "text": "body"}]}])
    a, b, c = load_dataset(path, None, None)
    assert a.answers == ["Paris"] and b.answers == ["1990", "2.5", "x"] and c.passages == ["body"]


def test_json_lines_datasets_are_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "question": "Q2"}) + "\n")
    assert [e.question for e in load_dataset(path, None, None)] == ["Where is Paris?", "Q2"]
    path.write_text(json.dumps(GOOD) + "\n")  # one line: a single example
    assert len(load_dataset(path, None, None)) == 1
    path.write_text(json.dumps(GOOD) + "\n{broken\n")
    with pytest.raises(RagfuseError, match="line 2 is not JSON"):
        load_dataset(path, None, None)


def test_gap_closed_is_null_where_reuse_leaves_no_gap():
    """Reuse's kl_tf 0 (one passage stored after the prefix is exact) or no reuse row: gap_closed
    has no value; it was NaN, which json.dumps writes as a bare NaN that is not JSON."""
    rows = [{"answer": "a", "full_answer": "a", "gold": ["a"], "kl_first": 0.0, "kl_tf": 9e-9, "ttft_s": 1.0,
             "recompute_ratio": 0.0}]
    for reuse_kl in (0.0, None, 3e-9):  # 3e-9: an exact reuse's rounding (it gave a fuse as exact -1.7)
        summary = summarize(rows, reuse_kl)
        assert summary["gap_closed"] is None
        json.dumps(summary, allow_nan=False)
    assert summarize([{**rows[0], "kl_tf": 0.05}], 0.1)["gap_closed"] == pytest.approx(0.5)


def test_kl_of_a_masked_vocabulary_entry_is_not_nan():
    from ragfuse.quality import kl_rows

    ref = torch.tensor([[0.0, 1.0, -math.inf], [2.0, 0.0, -math.inf]])
    other = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, -math.inf]])
    kl = kl_rows(ref, other)
    assert torch.isfinite(kl).all() and kl[0] > 0 and kl[1] == 0  # was NaN in both rows
    assert kl_rows(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, -math.inf]]))[0] == math.inf


@pytest.mark.parametrize("extra, needle", [
    (["--modes", "full,bogus"], "unknown eval mode(s) bogus"),
    (["--modes", " , "], "--modes names no mode"),
    (["--sweep", "--sweep-modes", "fuse,mapreduce"], "unknown eval mode(s) mapreduce"),
    (["--sweep-modes", "fuse"], "--sweep-modes needs --sweep"),  # was ignored: no sweep ran
    (["--sweep-limit", "3"], "--sweep-limit needs --sweep"),
    (["--sink-tokens", "-2"], "--sink-tokens must be at least 0"),  # recomputed everything, silently
    (["--tail-tokens", "-1"], "--tail-tokens must be at least 0"),
    (["--first-factor", "0.5"], "--first-factor must be a finite number of at least 1"),
    (["--attention-weight", "nan"], "--attention-weight must be a finite number"),
    (["--k-mass-cap", "-1"], "K mass cap must be a finite number of nats >= 0"),
    (["--out", "FILE"], "a file is in the way"),  # was a FileExistsError traceback after the whole run
])
def test_eval_arguments_are_checked_before_the_model_loads(tmp_path, capsys, extra, needle):
    """``--model no-such-model``: had the command reached the model, the error would be that one."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    argv = ["eval", "qa", "--dataset", str(_dataset(tmp_path, [GOOD])), "--model", "no-such-model",
            *[str(afile) if a == "FILE" else a for a in extra]]
    assert main(argv) == 2
    assert needle in _error_line(capsys)
    assert afile.read_text() == "keep me"


def test_check_layers_beyond_the_model_are_refused():
    """A check layer the model lacks: the funnel never narrows to r and 3r was recomputed silently."""
    from ragfuse.commands.eval import POLICY_ARGS, policy_from_args

    args = Namespace(**{**dict.fromkeys(POLICY_ARGS), "check_layers": "1,2,40"})
    assert policy_from_args(args, 0.15).check_layers == (1, 2, 40)  # the layer count is not known yet
    with pytest.raises(RagfuseError, match="below the model's 30 layers"):
        policy_from_args(args, 0.15, num_layers=30)


def test_write_report_is_atomic_and_writes_strict_json(tmp_path):
    """A write cut short (a file-size limit standing in for a full disk) leaves the previous results
    whole and says so in one line; the old in-place write left a truncated results.json."""
    from ragfuse.bench.report import write_report

    out = tmp_path / "out"
    write_report(out, "t", {"figure": math.nan}, [{"x": 1.0, "y": math.inf}])
    before = (out / "results.json").read_text()
    assert json.loads(before) == {"figure": None, "rows": [{"x": 1.0, "y": None}]}  # was NaN / Infinity
    code = ("import sys; from ragfuse.bench.report import write_report\n"
            "write_report(sys.argv[1], 't', {'big': 'x' * 100000}, [{'x': 2.0}])")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (50000,) * 2))
    assert r.returncode != 0 and "cannot write the results in" in r.stderr and "File too large" in r.stderr
    assert (out / "results.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # no temporary file left
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(RagfuseError, match="a file is in the way"):
        write_report(afile, "t", {}, [{"x": 1}])


def test_bench_out_that_is_a_file_fails_before_the_benchmark_runs(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    argv = ["bench", "tree", "--shape", "tiny-llama", "--shared", "64", "--batches", "3", "--private", "5",
            "--repeats", "1", "--device", "cpu", "--out", str(afile)]
    assert main(argv) == 2
    assert "a file is in the way" in _error_line(capsys)
    assert "bench tree" not in capsys.readouterr().out and afile.read_text() == "keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("bench", ["server", "server-reuse"])
def test_bench_server_on_cuda_without_cuda_is_one_line(capsys, bench):
    """It started a server process that loaded the model, died, and had its log pasted into the error."""
    assert main(["bench", bench, "--device", "cuda", "--out", "/nonexistent-never-created"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "ragfuse: error: --device cuda: no CUDA device here"


def test_evaluate_counts_a_repeated_mode_once_and_refuses_what_cannot_run(engine):
    """``--modes full,full`` ran full twice per case: n doubled and each case's row read another's run.
    An example without gold answers (F1 undefined) or one whose prompt overflows the model's context
    is refused before any case runs, naming it; they failed at the end of the run (max() of nothing)
    or at their turn, without saying which example."""
    ok = Example(["Paris is in France."], "Where is Paris?", ["France"])
    res = evaluate(engine, [ok, ok], ["full", "full"], 0.15, SelectionPolicy.default(), max_tokens=2)
    assert res["modes"]["full"]["n"] == 2 and len(res["cases"]) == 2
    with pytest.raises(RagfuseError, match="example 1 has no gold answer"):
        evaluate(engine, [ok, Example(["x"], "q", [])], ["full"], 0.15, SelectionPolicy.default(), max_tokens=2)
    huge = Example(["word " * (engine.max_model_len + 10)], "What?", ["x"])
    with pytest.raises(RagfuseError, match="example 1: its prompt of .* exceed the model's context"):
        evaluate(engine, [ok, huge], ["full"], 0.15, SelectionPolicy.default(), max_tokens=2)
