"""The engine against transformers' own implementation of the same weights (default model, fp32)."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers greater than 50.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]


def _chat(llm, text: str) -> list[int]:
    return llm.chat_ids([{"role": "user", "content": text}])


def test_last_token_logits_match_transformers(llm, hf_model):
    for text in PROMPTS[:5]:
        ids = _chat(llm, text)
        ours = llm.engine.score(ids, last_n=1)[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert (ours - ref).abs().max().item() < 1e-3, text


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' model decoding greedily with its own KV cache, ignoring end-of-turn: the prompts
    left-padded into one batch (masked, positions counted from each prompt's first real token), which
    gives the tokens of one-at-a-time decoding in a quarter of its time on CPU."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
        toks = [out.logits[:, -1].argmax(-1)]
        for _ in range(n - 1):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
            pos = pos[:, -1:] + 1
            out = model(toks[-1][:, None], attention_mask=mask, position_ids=pos, past_key_values=out.past_key_values,
                        use_cache=True)
            toks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(toks, 1).tolist()


def test_greedy_64_tokens_match_transformers(llm, hf_model):
    """64 tokens each, past end-of-turn on both sides, so every comparison is full length."""
    prompts = [_chat(llm, t) for t in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    assert [out.token_ids for out in outs] == hf_greedy(hf_model, prompts, 64)


def test_batched_equals_one_at_a_time(llm):
    prompts = [_chat(llm, t) for t in PROMPTS[:6]]
    prompts[2] = prompts[2] + prompts[3]  # lengths differ widely
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_logits_for_every_position_match(llm, hf_model):
    ids = _chat(llm, PROMPTS[0]) + llm.engine.tokenize("The capital of France is Paris.")
    ours = llm.engine.score(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_gives_the_same_tokens(llm, chunk):
    """A prompt prefilled in chunks (attending to the cached prefix) decodes the same tokens."""
    from ragfuse.engine import LLMEngine

    eng = llm.engine
    small = LLMEngine.__new__(LLMEngine)
    small.__dict__.update(eng.__dict__)
    small.scheduler = type(eng.scheduler)(eng.blocks, eng.config.max_num_seqs, chunk)
    small._seqs, small._detok = {}, {}
    ids = _chat(llm, PROMPTS[2])
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    rid = small.add_request(ids, params)
    steps = 0
    out = None
    while small.has_unfinished():
        for o in small.step():
            if o.request_id == rid:
                out = o
        steps += 1
    assert steps >= len(ids) // chunk  # it really ran in chunks
    assert out is not None and out.token_ids == llm.generate([ids], params)[0].token_ids
