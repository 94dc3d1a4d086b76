"""Streaming detokenization: concatenated deltas equal the final text, which is the tokenizers' own
decode of the tokens (cut at the first stop string), with characters split over byte tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ragfuse.engine.checkpoint import resolve
from ragfuse.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! 😀 This is 中文 text, 日本語 too. Ünïcödé ✓ done.",
    "🌟🌟 stars ⭐ and ❤️ hearts; 한국어 문장입니다.",
    "plain ascii only, with: punctuation... and\nnewlines\n\n",
]


@pytest.fixture(scope="module")
def byte_level():
    """SmolLM2's byte-level BPE: an incomplete character decodes as a single U+FFFD."""
    return AutoTokenizer.from_pretrained(str(resolve("smollm2-135m-instruct").path))


@pytest.fixture(scope="module")
def byte_fallback():
    """A sentencepiece-style tokenizer as Llama 2 and Mistral have: characters outside the vocabulary
    are <0xNN> byte tokens, and an incomplete character decodes as one U+FFFD per byte."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁stars", "▁and", "▁text", "s", "a", "b", ",", "."]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tok, ids: list[int], stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` one token at a time, as the engine does, until the end or a stop string."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas = []
    for i in range(1, len(ids) + 1):
        deltas.append(detok.update(ids[:i], final=i == len(ids)))
        if detok.stopped:
            break
    return deltas, detok


def expected_text(tok, ids: list[int], stop: list[str]) -> str:
    """The reference: generation stops at the first token whose decoded text holds a stop string, and
    the text is cut where the earliest one in it begins; without one it is the whole decode."""
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True)
        hits = [j for j in (text.find(s) for s in stop) if j >= 0]
        if hits:
            return text[: min(hits)]
    return tok.decode(ids, skip_special_tokens=True)


def random_case(rng: random.Random, tok, vocab_size: int) -> tuple[list[int], list[str]]:
    """Token ids of a sample text, sometimes with stray random tokens mixed in (incomplete or invalid
    byte runs), and zero to two stop strings cut from its decoded text."""
    ids = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 4)):
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(vocab_size))
    full = tok.decode(ids, skip_special_tokens=True).replace("\ufffd", "")
    stop = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        a = rng.randrange(len(full))
        stop.append(full[a : a + rng.randint(1, 4)])
    return ids, stop


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_random_streams_match_the_final_text_and_the_tokenizers_decode(kind, request):
    tok = request.getfixturevalue(kind)
    rng = random.Random(1234)
    for _ in range(400):
        ids, stop = random_case(rng, tok, len(tok))
        deltas, detok = stream(tok, ids, stop)
        want = expected_text(tok, ids, stop)
        assert (detok.text, "".join(deltas)) == (want, want), (ids, stop)
        if not stop:
            assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_ending_in_a_character_split_over_tokens_cuts_at_its_start(byte_level):
    """'🌟' is three byte-level tokens; the text before its last one ends in U+FFFD."""
    ids = byte_level.encode("ok 🌟🌟🌟", add_special_tokens=False)
    for stop in (["🌟"], ["🌟🌟"], ["x🌟", "🌟"], [" 🌟"]):
        deltas, detok = stream(byte_level, ids, stop)
        cut = "ok" if stop == [" 🌟"] else "ok "
        assert (detok.stopped, detok.text, "".join(deltas)) == (True, cut, cut)


def test_byte_fallback_stream_shows_a_run_of_byte_tokens_once_it_ends(byte_fallback):
    ids = byte_fallback.encode("a中😀b", add_special_tokens=False)
    assert len(ids) == 1 + 3 + 4 + 1  # the two characters are byte tokens
    deltas, detok = stream(byte_fallback, ids, [])
    assert deltas == ["a"] + [""] * 7 + ["中😀b"]
    assert detok.text == "a中😀b"


def test_byte_fallback_run_that_ends_invalid_replaces_no_shown_text(byte_fallback):
    """'中' then a truncated '中': the whole run decodes as five U+FFFD, the complete one included."""
    zhong = byte_fallback.encode("中", add_special_tokens=False)
    ids = zhong + zhong[:2] + byte_fallback.encode("a", add_special_tokens=False)
    deltas, detok = stream(byte_fallback, ids, [])
    assert "".join(deltas) == detok.text == byte_fallback.decode(ids) == "\ufffd" * 5 + "a"


def test_an_incomplete_character_at_the_end_is_shown_when_the_request_finishes(byte_fallback):
    ids = byte_fallback.encode("a中", add_special_tokens=False)[:-1]
    deltas, detok = stream(byte_fallback, ids, [])
    assert deltas == ["a", "", "\ufffd\ufffd"]
    assert detok.text == "".join(deltas) == byte_fallback.decode(ids)
