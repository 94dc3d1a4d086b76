"""Generation semantics a sampling audit found wrong: the end-of-sequence ids of generation_config.json,
and logits that overflow (a 16-bit output head, or a tiny temperature) under sampling."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from ragfuse.engine import LLM, SamplingParams
from ragfuse.engine.sampling import sample

PROMPT = [17, 101, 45, 200, 9, 33]


def _tiny_llama(path, gen_eos: int | list[int] | None = None) -> LlamaForCausalLM:
    """A random 2-layer Llama saved by transformers; config.json's eos is token 2."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, eos_token_id=2,
        bos_token_id=1, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2 if gen_eos is None else gen_eos)
    model.save_pretrained(path)
    return model


def _engine(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", block_size=4, kv_cache_bytes=1 << 22, **kw)


def test_an_eos_listed_only_in_generation_config_stops_like_transformers(tmp_path):
    """Llama 3 Instruct lists <|eot_id|> as an end only in generation_config.json: transformers stops
    there, the engine ran on to max_tokens (finish 'length', 20 tokens instead of 3)."""
    model = _tiny_llama(tmp_path)
    with torch.no_grad():
        free = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    end = free[2]  # the third greedy token becomes a second end-of-sequence id
    assert 2 not in free[:3] and end not in free[:2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}))
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                             generation_config=GenerationConfig.from_pretrained(tmp_path))[0, len(PROMPT):].tolist()
    assert ref == free[:3]

    llm = _engine(tmp_path)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20))[0]
    assert (out.finish_reason, out.token_ids) == ("stop", ref)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert (out.finish_reason, out.token_ids) == ("length", free)  # ignore_eos ignores that end too


def test_a_malformed_generation_config_adds_no_eos(tmp_path):
    _tiny_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text("[not an object")
    assert _engine(tmp_path).engine.eos_token_ids == {2}


def test_an_fp16_logit_that_overflows_to_inf_is_sampled_instead_of_failing_the_batch(tmp_path):
    """An fp16 output head saturates a large logit to +inf; the softmax of that row was NaN and
    torch.multinomial raised, failing the sampled request and the greedy one batched with it."""
    model = _tiny_llama(tmp_path)
    with torch.no_grad():
        model.lm_head.weight[5] *= 1e5
    model.save_pretrained(tmp_path)
    llm = _engine(tmp_path, dtype="float16")
    assert llm.engine.score(PROMPT, last_n=1)[0][5].item() == float("inf")
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
    outs = llm.generate([PROMPT, PROMPT], [greedy, sampled])
    assert [o.token_ids for o in outs] == [[5, 5, 5], [5, 5, 5]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=1e-4, top_k=3),
    SamplingParams(temperature=2.0, top_p=0.5),
])
def test_non_finite_and_huge_logits_sample_their_limit(params):
    """+inf logits share all the mass (one of them is drawn, as greedy picks one); a NaN logit is never
    drawn; finite logits whose quotient by the temperature overflows float32 still sample the top one."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [1.0, inf, 3.0, inf, nan],
        [nan, 0.5, nan, -inf, 0.0],
        [3e38, 2e38, 0.0, -3e38, 1.0],
        [nan, nan, -inf, nan, -inf],  # nothing drawable: the argmax, as greedy decoding would give
    ])
    seen: list[set[int]] = [set(), set(), set(), set()]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        for row, tok in enumerate(sample(logits, [params] * 4, [gen] * 4)):
            seen[row].add(tok)
    assert seen[0] <= {1, 3} and (params.top_p < 1.0 or seen[0] == {1, 3})  # top_p 0.5: one half of the tie
    assert seen[1] <= {1, 4} and (params.temperature < 1e-3 or params.top_p < 1.0 or seen[1] == {1, 4})
    assert seen[2] == {0}
    assert seen[3] == {int(logits[3].argmax())}


def test_finite_logits_keep_their_distribution():
    """The overflow handling shifts logits by their maximum before dividing: 4000 draws still follow
    softmax(logits / T) restricted to the top-p nucleus (a chi-square far below its 1e-3 tail)."""
    torch.manual_seed(3)
    logits = torch.randn(1, 12) * 2
    params = SamplingParams(temperature=0.8, top_p=0.95)
    probs = torch.softmax(logits[0] / 0.8, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < 0.95
    ref = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
    ref /= ref.sum()
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, [params], [gen])[0] for _ in range(n)]), minlength=12)
    assert counts[ref == 0].sum() == 0
    support = ref > 0
    chi2 = (((counts[support] - n * ref[support]) ** 2) / (n * ref[support])).sum().item()
    assert chi2 < 32.0  # 1e-3 tail of chi-square with <= 11 degrees of freedom is 31.3
