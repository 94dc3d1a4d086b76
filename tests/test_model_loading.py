"""Loading user checkpoints: what a hub fetch keeps, which weights files count, damaged files and
configs as one-line errors, and chat templates that refuse a system message, from ``generate`` to
``ingest`` and ``ask``. Every model here is a tiny random one saved by transformers (with a tiny
byte-level tokenizer where one is needed), so no test downloads or loads a real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from ragfuse.cli import main
from ragfuse.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from ragfuse.engine.checkpoint import HUB_ALLOW_PATTERNS, HUB_IGNORE_PATTERNS, Checkpoint, resolve
from ragfuse.engine.config import ModelConfig
from ragfuse.engine.errors import ModelError, RequestError
from ragfuse.prompt import DEFAULT_INSTRUCTION, RagPromptBuilder

VOCAB = 320
# Mistral v0.1's template: user and assistant turns only, a system message raises
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
DOCS = {
    "lighthouse.txt": "The Hollowpoint lighthouse was built in 1871 on the northern cape. It was electrified "
                      "in 1952, and its last keeper left in 1979 when the light became automatic.",
    "bakery.txt": "The Marlow bakery opened in 1923. Its rye bread uses a sourdough starter kept alive "
                  "for a century, fed twice a day with flour from the valley mill.",
    "river.txt": "The Sable river floods every spring. A dam upstream was finished in 1968 and now "
                 "supplies the town with water and electricity through the dry summer months.",
}


def tiny_tokenizer(path: Path, chat_template: str | None) -> None:
    """A byte-level BPE (every text encodes) with <s> and </s>, saved with ``chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*DOCS.values(), DEFAULT_INSTRUCTION], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)


def tiny_mistral(path: Path, chat_template: str | None = NO_SYSTEM_TEMPLATE, tokenizer: bool = True,
                 **save: object) -> Path:
    """A random 2-layer Mistral (no sliding window, so relay attention applies) saved in ``path``."""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        sliding_window=None, initializer_range=0.2, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).eval().save_pretrained(path, **save)
    if tokenizer:
        tiny_tokenizer(path, chat_template)
    return path


def engine_of(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, kv_cache_bytes=1 << 24))


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own loading of the checkpoint."""
    ref = MistralForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


# ---- which files make the model -------------------------------------------------------------------


def test_hub_fetch_keeps_the_chat_template_and_skips_consolidated_weights(tmp_path):
    """A repo as transformers saves it (chat template in chat_template.jinja) plus Mistral's native
    copy of the weights, filtered as ``snapshot_download`` filters a repo's listing with the patterns
    ragfuse passes it: the fetched folder loads with its chat template and without the copy."""
    from huggingface_hub.utils import filter_repo_objects

    repo = tiny_mistral(tmp_path / "repo")
    save_file({"tok_embeddings.weight": torch.zeros(VOCAB, 64)}, str(repo / "consolidated.safetensors"))
    listing = [p.name for p in repo.iterdir()]
    assert "chat_template.jinja" in listing and "chat_template" not in (repo / "tokenizer_config.json").read_text()
    fetched = list(filter_repo_objects(listing, allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS))
    assert "chat_template.jinja" in fetched and "consolidated.safetensors" not in fetched
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in fetched:
        shutil.copy(repo / name, snapshot / name)
    engine = engine_of(snapshot)
    assert engine.tokenizer.chat_template == NO_SYSTEM_TEMPLATE
    assert engine.chat_token_ids([{"role": "user", "content": "hi"}])[0] == engine.tokenizer.bos_token_id


@pytest.fixture
def hub_layout(tmp_path) -> Path:
    """Mistral's official repo layout: sharded weights with their index, and consolidated.safetensors,
    the same weights in Mistral's native tensor names (no place in the HF architecture)."""
    path = tiny_mistral(tmp_path / "mistral", tokenizer=False, max_shard_size="100KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").is_file()
    native = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            native[name.replace("model.layers.", "layers.").replace("model.", "")] = tensor.clone()
    save_file(native, str(path / "consolidated.safetensors"))
    return path


def test_sharded_weights_are_read_from_their_index_beside_a_consolidated_copy(hub_layout):
    engine = engine_of(hub_layout)
    ids = torch.randint(2, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    assert (engine.score(ids) - reference_logits(hub_layout, ids)).abs().max().item() < 1e-4


def test_fingerprint_counts_only_the_loaded_weights(hub_layout, tmp_path, monkeypatch):
    """The copy the engine never reads does not change the key of stored KV; a shard it reads does."""
    monkeypatch.setenv("RAGFUSE_CACHE", str(tmp_path / "cache"))
    first = Checkpoint("m", hub_layout).fingerprint
    (hub_layout / "consolidated.safetensors").write_bytes(b"anything")
    assert Checkpoint("m", hub_layout).fingerprint == first
    shard = sorted(hub_layout.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    save_file({k: v + 1 for k, v in tensors.items()}, str(shard))
    assert Checkpoint("m", hub_layout).fingerprint != first


def test_a_missing_shard_or_unnamed_weights_files_are_model_errors(hub_layout, tmp_path):
    shard = sorted(hub_layout.glob("model-*.safetensors"))[-1]
    moved = tmp_path / shard.name
    shard.rename(moved)
    with pytest.raises(ModelError, match=f"shard files .*index.json names are missing, e.g. {shard.name}"):
        engine_of(hub_layout)
    moved.rename(shard)
    (hub_layout / "model.safetensors.index.json").unlink()  # several files, none says which hold the model
    with pytest.raises(ModelError, match="neither model.safetensors nor model.safetensors.index.json"):
        engine_of(hub_layout)


def test_a_weights_file_passed_as_the_model_says_to_pass_its_folder(tmp_path):
    path = tiny_mistral(tmp_path / "m", tokenizer=False)
    with pytest.raises(ModelError, match=f"is a file, not a checkpoint: pass the folder .*--model {path}"):
        resolve(str(path / "model.safetensors"))


# ---- damaged weights and configs ------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "empty", "header"])
def test_damaged_weights_are_a_model_error_naming_the_file(tmp_path, damage):
    path = tiny_mistral(tmp_path / "m", tokenizer=False)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":  # an interrupted download
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data[8:40] = b"#" * 32
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=f"cannot read weights file {weights}"):
        engine_of(path)


def _config_dir(tmp_path: Path, edit) -> Path:
    path = tiny_mistral(tmp_path / "m", tokenizer=False)
    cfg = path / "config.json"
    cfg.write_text(edit(cfg.read_text()))
    return path


def test_config_that_is_not_json_is_a_model_error_naming_it(tmp_path):
    path = _config_dir(tmp_path, lambda text: text[:100])
    with pytest.raises(ModelError, match=f"{path / 'config.json'} is not valid JSON"):
        engine_of(path)


@pytest.mark.parametrize("change,message", [
    ({"num_attention_heads": None}, "lacks the required field 'num_attention_heads'"),
    ({"hidden_size": "wide"}, "has a field of the wrong kind"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["full_attention", "local"]}, "layer_types must list 2 entries"),
])
def test_config_field_missing_or_malformed_is_a_model_error_naming_it(tmp_path, change, message):
    def edit(text: str) -> str:
        cfg = json.loads(text)
        for key, value in change.items():
            if value is None:
                del cfg[key]
            else:
                cfg[key] = value
        return json.dumps(cfg)

    path = _config_dir(tmp_path, edit)
    with pytest.raises(ModelError, match=f"{path / 'config.json'}.*{message}"):
        ModelConfig.from_dir(path)


# ---- chat templates -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_system_model(tmp_path_factory) -> Path:
    return tiny_mistral(tmp_path_factory.mktemp("no-system") / "m")


@pytest.fixture(scope="module")
def no_system_llm(no_system_model) -> LLM:
    return LLM.from_engine(engine_of(no_system_model))


def test_a_system_message_the_template_refuses_goes_into_the_first_user_message(no_system_llm):
    """As such models' docs advise; what ``generate --system`` runs, with relay or without."""
    llm = no_system_llm
    messages = [{"role": "user", "content": "Where is the lighthouse?"}]
    ids = llm.chat_ids(messages, "Be brief.")
    assert llm.tokenizer.decode(ids) == "<s>[INST] Be brief.\n\nWhere is the lighthouse? [/INST]"
    system, rest = llm.relay_chat_ids(messages, "Be brief.")
    assert system is None and rest == ids  # the system text is no prefix of its own here: no relay
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert llm.generate([rest], params)[0].token_ids == llm.generate([ids], params)[0].token_ids


def test_the_baseline_chains_and_the_vllm_prompts_fold_a_refused_system_message(no_system_llm):
    """The LangChain baselines' template and the vLLM connector's prompts render chats through the
    same fold as the engine (they called the template themselves and crashed on such models)."""
    from ragfuse.baselines import chat_template
    from ragfuse.connectors.vllm.backend import PromptBuilder

    assert chat_template(no_system_llm.engine, "Be brief.", "{question}") == \
        "<s>[INST] Be brief.\n\n{question} [/INST]"
    builder = PromptBuilder()
    builder.tokenizer = no_system_llm.tokenizer
    prompt = builder.chunked_prompt("Where?", [[5, 6, 7]], system="Be brief.")
    (start, end), = prompt.chunks
    assert prompt.token_ids[start:end] == [5, 6, 7]
    text = no_system_llm.tokenizer.decode(prompt.token_ids)
    assert text.startswith("<s>[INST] Be brief.") and text.endswith("Question: Where? [/INST]")
    chat = builder.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert no_system_llm.tokenizer.decode(chat.token_ids) == "<s>[INST] Be brief.\n\nHi [/INST]"


def test_a_chat_the_template_refuses_otherwise_is_a_request_error(no_system_llm):
    with pytest.raises(RequestError, match="chat template refused the chat: Conversation roles must alternate"):
        no_system_llm.chat_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_tokenizer_without_chat_template_asks_for_raw_prompts(tmp_path):
    engine = engine_of(tiny_mistral(tmp_path / "m", chat_template=None))
    with pytest.raises(RequestError, match=r"no chat template: .*\(--raw\)"):
        engine.chat_token_ids([{"role": "user", "content": "hi"}])


def test_rag_prompt_instruction_is_a_token_prefix_when_the_template_refuses_system(no_system_llm):
    builder = RagPromptBuilder(no_system_llm.tokenizer)
    assert no_system_llm.tokenizer.decode(builder.prefix) == f"<s>[INST] {DEFAULT_INSTRUCTION}\n\n"
    passages = [builder.passage_tokens(text) for text in DOCS.values()]
    prompt = builder.token_ids(passages, "When was it electrified?")
    assert prompt[: len(builder.prefix)] == builder.prefix
    assert no_system_llm.tokenizer.decode(prompt).endswith("Question: When was it electrified? [/INST]")


def test_ingest_and_ask_with_a_template_that_refuses_system(no_system_model, tmp_path, capsys):
    """End to end through the CLI: chunk KV computed after the folded instruction prefix, which is
    served by relay; fusion at ratio 1 answers exactly as full prefill does."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    store = str(tmp_path / "store")
    common = ["--store", store, "--device", "cpu", "--json"]
    assert main(["ingest", str(docs), "--model", str(no_system_model), "--chunk-tokens", "64", *common]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["new_files"]) == 3 and report["kv_computed"] >= 3
    ask = ["ask", "When was the lighthouse electrified?", "--top-k", "2", "--max-tokens", "8", *common]
    assert main([*ask, "--mode", "fuse", "--recompute-ratio", "1.0", "--compare"]) == 0
    fused = json.loads(capsys.readouterr().out)
    full = fused.pop("compare")["full"]
    assert fused["token_ids"] == full["token_ids"] and fused["answer"] == full["answer"]
    assert fused["prompt_tokens"] == full["prompt_tokens"]
    assert fused["relay_system_tokens"] > 0  # the folded instruction prefix ran as a relay system prompt
    assert main([*ask, "--mode", "reuse"]) == 0  # the stored chunk KV (after the prefix) is served
    assert json.loads(capsys.readouterr().out)["reused_tokens"] > fused["relay_system_tokens"]


def test_ingest_with_a_model_without_tokenizer_fails_before_making_a_store(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOCS["river.txt"])
    model = tiny_mistral(tmp_path / "m", tokenizer=False)
    store = tmp_path / "store"
    capsys.readouterr()  # the model's save
    assert main(["ingest", str(docs), "--store", str(store), "--model", str(model), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ragfuse: error: model {model} has no tokenizer") and err.count("\n") == 1
    assert not store.exists()


def test_a_text_prompt_begins_with_the_tokenizers_bos_as_in_transformers(tmp_path):
    """A Llama-style tokenizer adds BOS to a prompt it encodes: a text prompt gets it, as
    transformers' ``tokenizer(prompt)`` and vLLM give it (the model answers otherwise without it), and
    the greedy tokens are transformers'; a prompt continuing a registered system prompt gets none (the
    system prompt, the sequence's start, has it), so relay or not the sequence holds one BOS."""
    from tokenizers import processors

    path = tiny_mistral(tmp_path / "m")
    fast = PreTrainedTokenizerFast.from_pretrained(str(path))
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", fast.bos_token_id)])
    fast.save_pretrained(path)
    prompt = "The Hollowpoint lighthouse"
    ids = fast(prompt)["input_ids"]
    assert ids[0] == fast.bos_token_id
    ref = MistralForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    llm = LLM.from_engine(engine_of(path))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert llm.generate([prompt], params)[0].token_ids == want
    sid = llm.engine.register_system("The Hollowpoint")
    assert llm.engine.systems.get(sid).token_ids[0] == fast.bos_token_id
    rid = llm.engine.add_request(" lighthouse", params, system=sid)
    assert llm.engine._seqs[rid].prompt_token_ids[0] != fast.bos_token_id



def test_a_follow_up_question_closes_the_answers_turn_once(no_system_llm):
    """The template's next user header after an answer: its end-of-turn token only where the answer
    did not end with it (or, for a model with several end tokens, with another of them)."""
    tok = no_system_llm.tokenizer
    builder = RagPromptBuilder(tok)
    answer = tok.encode("It was 1952.", add_special_tokens=False)
    assert tok.decode(builder.turn_head(answer)) == "</s>[INST] "  # an answer cut short: its turn closed
    assert tok.decode(builder.turn_head([*answer, tok.eos_token_id])) == "[INST] "
    other = tok.convert_tokens_to_ids("<unk>")
    assert tok.decode(builder.turn_head([*answer, other], ends={other, tok.eos_token_id})) == "[INST] "
    assert tok.decode(builder.tail("And then?", after_passages=False)) == "Question: And then? [/INST]"
