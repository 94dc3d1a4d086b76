"""LangChain's MapReduce and MapRerank chains over the engine, and their rows in ``ragfuse eval qa``."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("langchain_classic", reason="the baselines need ragfuse[langchain]")

from ragfuse.baselines import BaselineChains, ScoredAnswerParser, chat_template  # noqa: E402
from ragfuse.engine import LLM, SamplingParams  # noqa: E402
from ragfuse.engine.fusion import SelectionPolicy  # noqa: E402
from ragfuse.eval_qa import evaluate, load_dataset  # noqa: E402
from ragfuse.shared_data import shared_data

DATA = shared_data("musique_dev.json")


@pytest.fixture(scope="module")
def examples():
    if not DATA.exists():
        pytest.skip(f"no MuSiQue data at {DATA}")
    return load_dataset(DATA, limit=2, max_passages=2)  # two real cases, kept short for CPU


@pytest.fixture(scope="module")
def chains(engine):
    return BaselineChains(engine, max_tokens=8, map_tokens=16)


def test_scored_answer_parser_ranks_a_missing_score_last():
    p = ScoredAnswerParser()
    assert p.parse("Exeter College\nScore: 80") == {"answer": "Exeter College", "score": "80"}
    assert p.parse("Oxford. Score:95%") == {"answer": "Oxford.", "score": "95"}
    assert p.parse("The University of Oxford") == {"answer": "The University of Oxford", "score": "0"}


def test_chain_prompts_are_the_models_chat_turns(engine):
    template = chat_template(engine, "Be brief.", "{context}\n\nQuestion: {question}")
    text = template.format(context="A {braced} passage.", question="Why?")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert ids == engine.chat_token_ids([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "A {braced} passage.\n\nQuestion: Why?"}])


def test_mapreduce_maps_every_passage_alone_then_answers_from_the_notes(engine, chains, examples):
    ex = examples[0]
    r = chains.run("mapreduce", ex.passages, ex.question)
    assert r.llm_calls == 2
    notes, final = r.calls
    assert len(notes.outputs) == len(ex.passages) and len(final.outputs) == 1
    chain = chains.chains["mapreduce"]
    n_tokens = lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False))
    for passage, out in zip(ex.passages, notes.outputs, strict=True):  # one passage per map prompt
        assert out.prompt_tokens == n_tokens(chain.llm_chain.prompt.format(context=passage, question=ex.question))
    reduce_prompt = chain.reduce_documents_chain.combine_documents_chain.llm_chain.prompt
    summaries = "\n\n".join(o.text for o in notes.outputs)  # the notes, stuffed into one prompt
    assert final.outputs[0].prompt_tokens == n_tokens(reduce_prompt.format(summaries=summaries, question=ex.question))
    assert r.answer == final.outputs[0].text.strip()
    assert 0 < r.ttft_s < r.total_s
    assert final.started - r.calls[0].started < r.ttft_s


def test_maprerank_keeps_the_best_scored_answer(engine, chains, examples):
    ex = examples[1]
    r = chains.run("maprerank", ex.passages, ex.question)
    assert r.llm_calls == 1 and len(r.calls[0].outputs) == len(ex.passages)
    parsed = [ScoredAnswerParser().parse(o.text) for o in r.calls[0].outputs]
    best = max(parsed, key=lambda d: int(d["score"]))  # the first of equal scores, as LangChain's sort
    assert r.answer == best["answer"]
    assert r.ttft_s == r.total_s  # the answer is known only when every passage is scored
    # the chain's calls are the engine's own greedy answers to the same prompts
    prompt = chains.chains["maprerank"].llm_chain.prompt.format(context=ex.passages[0], question=ex.question)
    again = LLM.from_engine(engine).generate([prompt], SamplingParams(max_tokens=8 + 8))[0]
    assert again.text == r.calls[0].outputs[0].text


def test_eval_reports_baselines_beside_full(engine, examples):
    one = replace(examples[0], passages=examples[0].passages[:1])  # the rows' shape needs one passage, not two
    res = evaluate(engine, [one], ["full", "mapreduce", "maprerank"], 0.15, SelectionPolicy.default(), max_tokens=8)
    modes = res["modes"]
    assert set(modes) == {"full", "mapreduce", "maprerank"}
    for name in ("mapreduce", "maprerank"):
        m = modes[name]
        assert m["n"] == 1 and m["kl_tf"] is None and m["gap_closed"] is None
        assert 0.0 <= m["f1"] <= 1.0 and 0.0 <= m["f1_full"] <= 1.0 and m["ttft_s"] > 0
        assert m["recompute_ratio"] == 1.0
        assert all(isinstance(c["modes"][name]["answer"], str) for c in res["cases"])
    assert modes["full"]["agreement"] == 1.0
