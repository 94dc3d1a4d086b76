"""Two checkpoints the engine could not load: a hub repository that holds only pickled
``pytorch_model.bin`` weights (the fetch took safetensors only), and a YaRN scaling whose ``factor``
is null, which transformers derives from the two context lengths (DeepSeek-V3's configs). The hub
is a local HTTP server answering the endpoints huggingface_hub calls; RoPE tables are compared
bit for bit with transformers' own function."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ragfuse.engine.checkpoint import weight_files
from ragfuse.engine.config import ModelConfig
from ragfuse.engine.errors import ModelError
from tests.checkpoint_helpers import save_edited, tiny_engine, to_pickled

TINY: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, tie_word_embeddings=False,
)

# ---- YaRN: a null factor, the trained context -------------------------------------------------------

# (top-level fields beside the tiny config, rope_scaling): each one transformers runs; the engine refused
# the null factors
YARN_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "trained-context-in-scaling": ({}, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}),
    "legacy-type-key": ({}, {"type": "yarn", "factor": None, "original_max_position_embeddings": 48}),
    "no-trained-context": ({}, {"rope_type": "yarn", "factor": None}),
    "trained-context-top-level": ({"original_max_position_embeddings": 32},
                                  {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}),
    "no-max-position-embeddings": ({"max_position_embeddings": None},
                                   {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512}),
    "deepseek-mscale-pair": ({}, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64,
                                  "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}),
    "mistral": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
                {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 100}),
    # a top-level trained context (Phi-3 keeps it there) overrides the scaling's, also under a given factor,
    # and for llama3: the engine read the scaling's
    "given-factor-top-level-trained-context": ({"original_max_position_embeddings": 32}, {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
    "llama3-top-level-trained-context": ({"original_max_position_embeddings": 32}, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}),
}


def _config_json(tmp_path: Path, top: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """A config.json as a user would write it (None at the top level: the key left out), saved for
    transformers to read."""
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, **top,
                           "rope_scaling": dict(scaling)}
    cfg = {k: v for k, v in cfg.items() if not (k in top and v is None)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("case", list(YARN_CONFIGS))
def test_yarn_factor_and_trained_context_read_as_transformers_reads_them(tmp_path, case):
    """The engine refused ``factor: null`` ("lacks factor"); transformers runs it with the factor
    max_position_embeddings / original_max_position_embeddings. Same frequencies bit for bit, same
    attention factor."""
    cfg = _config_json(tmp_path, *YARN_CONFIGS[case])
    theirs = AutoConfig.from_pretrained(tmp_path)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[theirs.rope_parameters["rope_type"]](theirs, torch.device("cpu"))
    ours = ModelConfig.from_dict(cfg)
    assert torch.equal(ours.rope.inv_frequencies(ours.head_dim), inv_freq)
    assert ours.rope.attention_factor == attention_factor
    assert ours.max_position_embeddings == theirs.max_position_embeddings


def test_null_yarn_factor_logits_match_transformers(tmp_path):
    """End to end: 200 positions over a model trained at 64, stretched by the derived factor 4."""
    torch.manual_seed(0)
    path = save_edited(tmp_path, HFLlama(LlamaConfig(**TINY)), lambda c: c.update(
        rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}))
    engine = tiny_engine(path)
    assert engine.model_config.rope.factor == 4.0
    ids = torch.randint(2, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = HFLlama.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert (engine.score(ids) - want).abs().max().item() < 1e-4


# (top-level fields, rope_scaling, what the engine's one-line error says): each one transformers refuses
REFUSED_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "factor-missing": ({}, {"rope_type": "yarn", "original_max_position_embeddings": 64}, "'yarn' lacks factor"),
    "trained-context-null": ({}, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": None},
                             "original_max_position_embeddings in the rope scaling must be a positive number"),
    "trained-context-zero": ({}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
                             "original_max_position_embeddings in the rope scaling must be a positive number"),
    "top-level-trained-context-null": ({"original_max_position_embeddings": None}, {"rope_type": "yarn",
                                       "factor": None, "original_max_position_embeddings": 64},
                                       "original_max_position_embeddings in the config must be a positive number"),
    "llama3-trained-context-null": ({}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": None},
                                    "original_max_position_embeddings in the rope scaling must be"),
    "linear-factor-null": ({}, {"rope_type": "linear", "factor": None}, "'linear' lacks factor"),
}


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_configs_transformers_cannot_run_stay_one_line_model_errors(tmp_path, case):
    """A null factor is derived for yarn only, and only from a usable trained context: what
    transformers fails on (a missing key, a division by None or zero) the engine refuses, naming the
    field, instead of guessing (an explicit null or 0 trained context was read as
    max_position_embeddings)."""
    top, scaling, message = REFUSED_CONFIGS[case]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, **top, "rope_scaling": dict(scaling)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception):  # noqa: B017, PT011 - transformers' own errors vary by case
        theirs = AutoConfig.from_pretrained(tmp_path)
        ROPE_INIT_FUNCTIONS[scaling.get("rope_type", scaling.get("type"))](theirs, torch.device("cpu"))
    with pytest.raises(ModelError, match=message) as info:
        ModelConfig.from_dict(cfg)
    assert "\n" not in str(info.value)


# ---- a hub repository of pickled weights --------------------------------------------------------------


class _Hub(ThreadingHTTPServer):
    """The hub endpoints huggingface_hub's snapshot_download calls (repo info, file tree, file
    download), serving folders as repositories at one commit; ``fetched`` lists each file sent."""

    def __init__(self, repos: dict[str, Path]) -> None:
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.repos = repos
        self.fetched: list[tuple[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()


class _HubHandler(BaseHTTPRequestHandler):
    server: _Hub

    def log_message(self, *_: object) -> None:
        """Quiet: the test asserts on ``fetched`` instead."""

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        parts = unquote(urlsplit(self.path).path).strip("/").split("/")
        api = parts[0] == "api"
        repo = "/".join(parts[2:4] if api else parts[0:2])
        folder = self.server.repos.get(repo)
        if folder is None:
            return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        files = sorted(f.name for f in folder.iterdir())
        sha = _Hub.commit(repo)
        if api and parts[4] == "revision":
            info = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
            return self._send(200, json.dumps(info).encode(), {}, body)
        if api and parts[4] == "tree":
            tree = [{"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": _etag(folder / f)}
                    for f in files]
            return self._send(200, json.dumps(tree).encode(), {}, body)
        name = "/".join(parts[4:])  # <org>/<name>/resolve/<revision>/<file>
        if parts[2] != "resolve" or name not in files:
            return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        if body:
            self.server.fetched.append((repo, name))
        data = (folder / name).read_bytes()
        return self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{_etag(folder / name)}"'}, body)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


def _etag(file: Path) -> str:
    return hashlib.sha1(file.read_bytes()).hexdigest()


@contextmanager
def _hub(repos: dict[str, Path]) -> Iterator[_Hub]:
    hub = _Hub(repos)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.shutdown()
        hub.server_close()
        thread.join()


# resolves each hub id in a fresh interpreter, as a server start does: huggingface_hub reads HF_ENDPOINT,
# HF_HUB_OFFLINE and the cache folder once, when it is imported
_RESOLVE = """
import json, sys
from ragfuse.engine.checkpoint import resolve, weight_files
from ragfuse.engine.errors import ModelError
out = {}
for repo in sys.argv[1:]:
    try:
        checkpoint = resolve(repo)
        out[repo] = [str(checkpoint.path), [str(f) for f in weight_files(checkpoint.path)]]
    except ModelError as exc:
        out[repo] = str(exc)
print(json.dumps(out))
"""


def _resolve(tmp: Path, endpoint: str, offline: bool, *repos: str) -> dict[str, Any]:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HOME": str(tmp / "hf"), "HF_HUB_CACHE": str(tmp / "hf" / "hub"), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5", "RAGFUSE_CACHE": str(tmp / "ragfuse")}
    done = subprocess.run([sys.executable, "-c", _RESOLVE, *repos], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory) -> dict[str, Path]:
    """Three repositories of one tiny Llama: pickled weights in one file, in shards beside an
    optimizer state that is no weights, and safetensors beside pickled twins."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("repos")
    repos = {}
    for repo, shards in (("tiny/llama-bin", 1), ("tiny/llama-bin-sharded", 3), ("tiny/llama-both", 0)):
        folder = save_edited(root / repo.replace("/", "--"), HFLlama(LlamaConfig(**TINY)))
        if shards:
            to_pickled(folder, shards)
        else:
            torch.save(dict(HFLlama(LlamaConfig(**TINY)).state_dict()), folder / "pytorch_model.bin")
        repos[repo] = folder
    (repos["tiny/llama-bin-sharded"] / "optimizer.bin").write_bytes(b"\0" * 4096)
    return repos


def test_a_hub_repository_of_pickled_weights_is_fetched_and_loads(tmp_path, hub_repos):
    """The fetch took safetensors only: a repo of pytorch_model.bin weights came without weights
    ("no *.safetensors files and no pytorch_model.bin"). Now its pickled weights are fetched, those
    of a repo with safetensors are not, and the engine reads them from the snapshot folder, with
    transformers' logits; a hub that cannot be reached then serves the cached snapshot (with or
    without HF_HUB_OFFLINE), and a repo never fetched is the one-line ModelError it was."""
    with _hub(hub_repos) as hub:
        online = _resolve(tmp_path, hub.url, False, *hub_repos)
        endpoint = hub.url
    snapshots = tmp_path / "hf" / "hub"
    assert not any(isinstance(result, str) for result in online.values()), online  # a ModelError each
    for repo, (path, files) in online.items():
        assert Path(path) == snapshots / f"models--{repo.replace('/', '--')}" / "snapshots" / _Hub.commit(repo)
        assert files and all(Path(f).parent == Path(path) for f in files)
    bins = sorted(f for repo, f in hub.fetched if f.endswith(".bin"))
    assert bins == ["pytorch_model-00001-of-00003.bin", "pytorch_model-00002-of-00003.bin",
                    "pytorch_model-00003-of-00003.bin", "pytorch_model.bin"]
    assert ("tiny/llama-bin", "pytorch_model.bin") in hub.fetched
    assert [Path(f).name for f in online["tiny/llama-both"][1]] == ["model.safetensors"]

    for repo in ("tiny/llama-bin", "tiny/llama-bin-sharded"):
        path = Path(online[repo][0])
        assert weight_files(path) == [Path(f) for f in online[repo][1]]
        engine = tiny_engine(path)
        ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        ref = HFLlama.from_pretrained(str(hub_repos[repo]), dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        assert (engine.score(ids) - want).abs().max().item() < 1e-4, repo

    for offline in (True, False):  # the server is down now
        again = _resolve(tmp_path, endpoint, offline, "tiny/llama-bin", "tiny/llama-bin-sharded", "tiny/never")
        assert again["tiny/llama-bin"] == online["tiny/llama-bin"]
        assert again["tiny/llama-bin-sharded"] == online["tiny/llama-bin-sharded"]
        assert again["tiny/never"].startswith("model 'tiny/never' is not available locally and could not be fetched")
        assert "\n" not in again["tiny/never"]


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
@pytest.mark.parametrize("factor", [0, -2.0])
def test_non_positive_rope_factor_is_refused_not_run_into_nan(kind, factor):
    """transformers takes a factor of 0 or below and computes NaN or infinite frequencies (every
    logit NaN); the engine refuses the config, naming the factor."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
           "rope_scaling": {"rope_type": kind, "factor": factor}}
    with pytest.raises(ModelError, match=f"has factor {float(factor)!r}: it must be a positive number"):
        ModelConfig.from_dict(cfg)
