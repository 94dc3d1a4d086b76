"""LangChain's MapReduce and MapRerank QA chains over ragfuse's engine: the RAG baselines that
CacheBlend compares cache fusion against (its section 7).

Both process each passage alone, so no chunk needs to see another's KV: MapReduce asks the model
for the relevant facts of every passage (one batched call), then answers from those notes (a second
call); MapRerank answers from every passage alone with a confidence score and keeps the best. The
chains are LangChain's own (``langchain-classic``), run through a LangChain completion model over
the engine, so the comparison is with what a LangChain user gets, not with a re-implementation.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from langchain_classic.chains import LLMChain, MapReduceDocumentsChain, MapRerankDocumentsChain
from langchain_classic.chains.combine_documents.reduce import ReduceDocumentsChain
from langchain_classic.chains.combine_documents.stuff import StuffDocumentsChain
from langchain_classic.output_parsers.regex import RegexParser
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, LLMResult
from langchain_core.prompts import PromptTemplate
from pydantic import ConfigDict, PrivateAttr

from ragfuse.engine import LLM, LLMEngine, RagfuseError, RequestOutput, SamplingParams
from ragfuse.engine.chat_template import render_chat

MAP_INSTRUCTION = (
    "You are given one passage and a question. Write down, in one or two sentences, what the passage says "
    "that helps answer the question. If it says nothing that helps, write: nothing relevant."
)
REDUCE_INSTRUCTION = (
    "You are given notes taken from several passages and a question. Answer the question using the notes. "
    "Answer within a few words."
)
RERANK_INSTRUCTION = (
    "You are given one passage and a question. Answer the question using the passage, within a few words. "
    "Then, on a new line, write 'Score: ' and a number from 0 (the passage does not tell) to 100 (the passage "
    "tells the answer exactly)."
)


@dataclass
class _Call:
    """One batch of prompts a chain sent to the model: when it started and what came back."""

    started: float
    outputs: list[RequestOutput]


@dataclass
class BaselineResult:
    answer: str
    ttft_s: float  # chain start to the final answer's first token
    total_s: float
    llm_calls: int  # batches sent to the model (each passage of a batch is one prompt in it)
    prompt_tokens: int  # over every prompt of every call
    calls: list[_Call] = field(default_factory=list, repr=False)


class EngineCompletionLLM(BaseLLM):
    """LangChain's completion-model interface over the engine. A chain's map step hands over all
    its prompts at once; they run as one batch (the engine's continuous batching), as the chains
    intend ("parallelized"). Every batch is recorded with its start time, for TTFT."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: Any
    _calls: list[_Call] = PrivateAttr(default_factory=list)

    @property
    def calls(self) -> list[_Call]:
        return self._calls

    @property
    def _llm_type(self) -> str:
        return "ragfuse-engine"

    def get_num_tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _generate(
        self, prompts: list[str], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        params = SamplingParams(max_tokens=int(kwargs.get("max_tokens", 32)), stop=list(stop or []))
        started = time.perf_counter()
        outputs = LLM.from_engine(self.engine).generate(list(prompts), params)
        self._calls.append(_Call(started, outputs))
        return LLMResult(
            generations=[[Generation(text=o.text, generation_info={"finish_reason": o.finish_reason})]
                         for o in outputs],
            llm_output={"token_usage": {"prompt_tokens": sum(o.prompt_tokens for o in outputs),
                                        "completion_tokens": sum(len(o.token_ids) for o in outputs)}},
        )


class ScoredAnswerParser(RegexParser):
    """Answer and score of one MapRerank call. A small model often leaves the score line out: that
    answer then ranks with score 0 instead of failing the whole chain (as LangChain's parser would)."""

    regex: str = r"(?s)(.*?)\s*Score:\s*(\d+)"
    output_keys: list[str] = ["answer", "score"]

    def parse(self, text: str) -> dict[str, str]:
        match = re.search(self.regex, text)
        if match is None:
            return {"answer": text.strip(), "score": "0"}
        return {"answer": match.group(1).strip(), "score": match.group(2)}


def chat_template(engine: LLMEngine, instruction: str, user: str) -> str:
    """The model's chat prompt as a LangChain template string: ``user`` may hold ``{variables}``.

    Rendered once with the checkpoint's own chat template, so every call is a proper chat turn even
    though the chains speak to a completion model."""
    if not getattr(engine.tokenizer, "chat_template", None):  # a base model: plain text
        return f"{instruction}\n\n{user}\nAnswer:"
    marker = "\x00ragfuse-user\x00"
    text = render_chat(
        engine.tokenizer, [{"role": "system", "content": instruction}, {"role": "user", "content": marker}],
        tokenize=False, add_generation_prompt=True,
    )
    head, tail = text.replace("{", "{{").replace("}", "}}").split(marker)
    return head + user + tail


class BaselineChains:
    """Both chains over one engine; ``run`` answers one question from its passages."""

    def __init__(self, engine: LLMEngine, max_tokens: int = 16, map_tokens: int = 48) -> None:
        self.engine = engine
        self.llm = EngineCompletionLLM(engine=engine)
        user = "{context}\n\nQuestion: {question}"
        with warnings.catch_warnings():  # LangChain marks these classic chains deprecated; they are the baseline
            warnings.simplefilter("ignore")
            map_chain = LLMChain(llm=self.llm, prompt=PromptTemplate.from_template(
                chat_template(engine, MAP_INSTRUCTION, user)), llm_kwargs={"max_tokens": map_tokens})
            reduce_chain = LLMChain(llm=self.llm, prompt=PromptTemplate.from_template(
                chat_template(engine, REDUCE_INSTRUCTION, "{summaries}\n\nQuestion: {question}")),
                llm_kwargs={"max_tokens": max_tokens})
            mapreduce = MapReduceDocumentsChain(
                llm_chain=map_chain, document_variable_name="context",
                reduce_documents_chain=ReduceDocumentsChain(
                    combine_documents_chain=StuffDocumentsChain(llm_chain=reduce_chain,
                                                                document_variable_name="summaries"),
                    token_max=engine.max_model_len // 2,
                ),
            )
            rerank_prompt = PromptTemplate(
                template=chat_template(engine, RERANK_INSTRUCTION, user), input_variables=["context", "question"],
                output_parser=ScoredAnswerParser(),
            )
            # room for the score line after an answer of ``max_tokens``
            rerank_chain = LLMChain(llm=self.llm, prompt=rerank_prompt, llm_kwargs={"max_tokens": max_tokens + 8})
            maprerank = MapRerankDocumentsChain(
                llm_chain=rerank_chain, document_variable_name="context", rank_key="score", answer_key="answer",
            )
        self.chains = {"mapreduce": mapreduce, "maprerank": maprerank}

    def run(self, mode: str, passages: list[str], question: str) -> BaselineResult:
        chain = self.chains.get(mode)
        if chain is None:
            raise RagfuseError(f"unknown baseline {mode!r} ({', '.join(self.chains)})")
        docs = [Document(page_content=p) for p in passages]
        self.llm.calls.clear()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = chain.invoke({"input_documents": docs, "question": question})
        end = time.perf_counter()
        calls = list(self.llm.calls)
        if mode == "mapreduce":  # the final answer streams from the last call (the reduce step)
            last = calls[-1]
            ttft = last.started + (last.outputs[0].ttft_s or 0.0) - t0
        else:  # the answer is known only once every passage's answer is scored: the chain's end
            ttft = end - t0
        outs = [o for c in calls for o in c.outputs]
        return BaselineResult(
            answer=str(out["output_text"]).strip(), ttft_s=ttft, total_s=end - t0, llm_calls=len(calls),
            prompt_tokens=sum(o.prompt_tokens for o in outs), calls=calls,
        )

