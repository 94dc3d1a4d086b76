"""What the selection studies in scripts/ share: the default model on the CPU and the dev-set cases they run
their variants on, each case's full prefill made as it is reached (a case costs seconds)."""

from __future__ import annotations

from collections.abc import Iterator

from ragfuse.engine import EngineConfig, LLMEngine
from ragfuse.eval_qa import load_dataset
from ragfuse.prompt import RagPromptBuilder
from ragfuse.quality import Case, build_case
from ragfuse.shared_data import shared_data


def study_cases(dataset: str, cases: str, answer_tokens: int = 16) -> tuple[LLMEngine, Iterator[tuple[int, Case]]]:
    """The engine and, lazily, (index, case) for the comma-separated ``cases`` of ``dataset`` (a file under
    ../shared/data or a path), with their first 6 passages as the eval takes them."""
    picks = [int(x) for x in cases.split(",")]
    examples = load_dataset(shared_data(dataset), max(picks) + 1, 6)
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", device="cpu"))
    builder = RagPromptBuilder(engine.tokenizer)

    def build() -> Iterator[tuple[int, Case]]:
        for i in picks:
            yield i, build_case(engine, builder, examples[i].passages, examples[i].question, answer_tokens)

    return engine, build()
