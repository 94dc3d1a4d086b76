"""TokenChunker with the default model's real tokenizer (no model weights loaded)."""

from __future__ import annotations

import random
import string

import pytest

from ragfuse.chunking import Chunk, TokenChunker


def _prose(n: int) -> str:
    return "".join(f"On evening {i} the keeper climbed the stairs to light the lamp. " for i in range(n))


def _run(n: int, seed: int = 0) -> str:
    """``n`` letters and digits without a separator, never repeating (so a chunk's place is unique)."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ragfuse.engine.checkpoint import resolve

    return AutoTokenizer.from_pretrained(str(resolve("smollm2-135m-instruct").path))


@pytest.fixture
def tokenizer_calls(tokenizer, monkeypatch):
    """The length of the text of every call into ``tokenizer`` (tokenize, encode and __call__ all
    go through ``_encode_plus``); the real tokenizer still does the work."""
    calls: list[int] = []
    real = type(tokenizer)._encode_plus

    def counted(self, text, *args, **kwargs):
        calls.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "_encode_plus", counted)
    return calls


def _check_covers(text: str, chunks: list[Chunk], tokenizer, chunk_tokens: int) -> None:
    """Chunks, in order, hold every character of ``text`` but the whitespace between them (overlapping
    chunks may repeat some), each within the chunk size and tokenized as its text is."""
    covered = 0  # text[:covered] is in some chunk, or whitespace
    start = -1
    for c in chunks:
        assert 0 < len(c.token_ids) <= chunk_tokens
        assert c.token_ids == tuple(tokenizer.encode(c.text, add_special_tokens=False))
        latest = covered + len(text[covered:]) - len(text[covered:].lstrip())  # it must start by here
        start = next((p for p in range(latest, start, -1) if text.startswith(c.text, p)), None)
        assert start is not None, f"text lost before {c.text[:40]!r}"
        covered = max(covered, start + len(c.text))
    assert not text[covered:].strip()


def test_a_huge_line_without_separators_costs_a_few_tokenizer_calls_per_chunk(tokenizer, tokenizer_calls):
    line = _run(48_000)  # the splitter's last resort counted the tokens of each character alone
    chunks = TokenChunker(tokenizer, 64).split(line)
    assert "".join(c.text for c in chunks) == line
    _check_covers(line, chunks, tokenizer, 64)
    # the line is tokenized in a few passes over bounded pieces, and each chunk once more for its own ids
    # (twice where the cut made it a token longer); it was two calls per character
    assert len(tokenizer_calls) <= 3 * len(chunks) + 10
    assert sum(tokenizer_calls) <= 5 * len(line) and max(tokenizer_calls) <= 64 * 64


@pytest.mark.parametrize("overlap", [0, 8])
def test_chunks_cover_the_whole_text(tokenizer, overlap):
    text = (_prose(40) + "\n\n" + _run(10_000) + " and then " + _run(3000, seed=1) + "\n" + _prose(10)
            + "".join(f"東京{i}は日本の首都である。🙂🚀👍🏽" for i in range(40)))
    chunks = TokenChunker(tokenizer, 64, overlap).split(text)
    _check_covers(text, chunks, tokenizer, 64)


def test_prose_chunks_fill_the_chunk_size(tokenizer):
    """Cutting a piece that came back a token too long (at a seam) leaves no one-token chunks behind."""
    chunks = TokenChunker(tokenizer, 64).split(_prose(100))
    assert min(len(c.token_ids) for c in chunks[:-1]) >= 56
