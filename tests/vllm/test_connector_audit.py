"""Failure modes of the vLLM connector a user hits: malformed chunk marks, bad settings, a corrupt entry
whose failed load must not poison what the same step saves, a full disk, and the report's counts.

Two engine start-ups for the module: vLLM alone computes the references, then one engine with the
connector serves every test. Its store sits on a small tmpfs of its own where this process may mount
one (root), so a full disk can be made for real; elsewhere the full-disk test is skipped.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragfuse.connectors.vllm.plan import normalise_chunks, plan_spans
from ragfuse.connectors.vllm.settings import ConnectorSettings, SettingsError
from tests.vllm.vllm_helpers import wait_saved

MAX_TOKENS = 8


# ---------------------------------------------------------------- no engine needed


@pytest.mark.parametrize("chunks", [
    "0-5", 5, {"a": 1}, [[1]], [[0, 1, 2]], [5], [[1.5, 3]], [["0", "3"]], [[True, 3]], [[-1, 3]],
    [[3, 3]], [[0, 11]], [[0, 5], [4, 8]],
], ids=["str", "int", "dict", "short", "triple", "flat", "float", "strings", "bool", "negative", "empty",
        "outside", "overlap"])
def test_malformed_chunk_marks_raise_value_error_naming_them(chunks: object) -> None:
    """Every malformed mark is a ``ValueError`` (the connector turns it into an ignored mark), never a
    TypeError, and never a silently truncated span (``int(1.5)``) loading KV at other tokens."""
    with pytest.raises(ValueError, match="chunk"):
        normalise_chunks(chunks, 10)


def test_unsorted_chunk_marks_are_sorted() -> None:
    assert normalise_chunks([(6, 8), [0, 5]], 10) == [(0, 5), (6, 8)]
    assert normalise_chunks(None, 10) == []


@pytest.mark.parametrize("bad", [
    {"span_tokens": 0}, {"span_tokens": -128}, {"span_tokens": "128"}, {"kv_dtype_name": "fp8"},
    {"memory_mb": -1}, {"disk_gb": 0}, {"disk_gb": "8"}, {"store_dir": ""}, {"fingerprint": None},
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bad_settings_are_refused_when_built(bad: dict) -> None:
    """Refused at start-up (vLLM builds the settings when it creates the connector), with the setting
    named; before, ``span_tokens=0`` or an unknown dtype stopped the engine at its first request."""
    values = {"store_dir": "/tmp/kv", "fingerprint": "fp", **bad}
    name = next(iter(bad))
    with pytest.raises(SettingsError, match=name):
        ConnectorSettings(**values)


# ---------------------------------------------------------------- with vLLM

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see test_connector.py

from ragfuse.connectors.vllm.backend import (  # noqa: E402
    Prompt,
    VLLMBackend,
    compute_dtype,
    engine_kwargs,
    openai_server_command,
)


def _vllm_config(extra: dict) -> object:
    """vLLM's own config object, as the connector receives it (no engine is started)."""
    from vllm.config import KVTransferConfig, VllmConfig

    return VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="RagfuseKVConnector", kv_role="kv_both",
        kv_connector_module_path="ragfuse.connectors.vllm.connector", kv_connector_extra_config=extra))


@pytest.mark.parametrize("extra, message", [
    ({"store_dir": "/tmp/kv", "fingerprint": "fp", "span_token": 64}, "unknown .*span_token"),
    ({"fingerprint": "fp"}, "store_dir"),
    ({"store_dir": "/tmp/kv", "fingerprint": "fp", "span_tokens": "64"}, "span_tokens"),
], ids=["typo", "no-store-dir", "string-number"])
def test_bad_extra_config_is_refused_with_the_key_named(extra: dict, message: str) -> None:
    """A misspelt key was a bare TypeError from the dataclass; a missing store_dir too."""
    with pytest.raises(SettingsError, match=message):
        ConnectorSettings.from_vllm(_vllm_config(extra))


def test_bad_dtype_is_refused_for_a_model_directory_too() -> None:
    """The model-directory path (no fingerprint given, the README's ``for_model``) skipped the dtype
    check: the engine started and failed at its first request with a KeyError."""
    from ragfuse.engine.checkpoint import DEFAULT_MODEL, resolve

    with pytest.raises(SettingsError, match="kv_dtype_name"):
        ConnectorSettings.for_model(resolve(DEFAULT_MODEL).path, "/tmp/kv", kv_dtype_name="fp8")


def test_a_store_folder_that_cannot_be_created_is_a_clear_start_up_error(tmp_path: Path) -> None:
    from ragfuse.connectors.vllm.settings import PendingSaves

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SettingsError, match="cannot create the store directory"):
        PendingSaves(blocker)


def test_vllm_computes_in_the_dtype_asked_for_else_the_hardwares() -> None:
    """bf16 only where the hardware computes it (on this AVX2 box vLLM's bf16 ran 4.7x slower than float32);
    a dtype asked for goes through unchanged, to the offline engine and to vLLM's own server."""
    import torch

    from ragfuse.engine.checkpoint import DEFAULT_MODEL, resolve

    native = torch.cuda.is_available() or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert compute_dtype() == ("bfloat16" if native else "float32")
    model_dir = resolve(DEFAULT_MODEL).path
    assert engine_kwargs(model_dir, None)["dtype"] == compute_dtype()
    assert engine_kwargs(model_dir, None, dtype="float16")["dtype"] == "float16"
    argv = openai_server_command(dtype="bfloat16")
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def _texts(backend: VLLMBackend) -> dict[str, list[int]]:
    story = backend.encode("Alice went to the market to buy apples, pears and a loaf of fresh bread. " * 30)
    other = backend.encode("Then Bob arrived with his dog and they talked about the weather for hours. " * 12)
    shared = backend.encode("System: you are a terse assistant who answers in one word only please. " * 12)
    fox = backend.encode("The quick brown fox jumps over the lazy dog near the river bank. " * 25)
    return {
        "stored": story[:450],  # four spans; its second is corrupted below
        "shares_two_spans": story[:256] + other[:200],  # its third span is saved in the step the load fails
        "fox": fox[:301], "fox_prefix_200": fox[:200], "fox_prefix_129": fox[:129], "fox_prefix_127": fox[:127],
        "fox_longer": fox[:301] + backend.encode(" What animal jumps? Answer:"),
        "batch_a": shared + backend.encode(" Q: capital of France?"),
        "batch_b": shared + backend.encode(" Q: colour of the sky on a clear day?"),
        "batch_c": shared + backend.encode(" Q: two plus two?"),
        "malformed": backend.encode("Chunk marks from a client may be anything at all. " * 10),
        "disk_full": backend.encode("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20),
    }


@pytest.fixture(scope="module")
def reference() -> dict:
    """Prompts, and greedy outputs with first-token logprobs of vLLM alone."""
    backend = VLLMBackend(connector=False)
    try:
        prompts = _texts(backend)
        outs = {k: backend.generate(Prompt(v), max_tokens=MAX_TOKENS, logprobs=5) for k, v in prompts.items()}
        return {"prompts": prompts, "ids": {k: o.token_ids for k, o in outs.items()},
                "first": {k: o.first_logprobs for k, o in outs.items()}}
    finally:
        backend.close()


@pytest.fixture(scope="module")
def store_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, bool]]:
    """A folder for the store, on a tmpfs of its own when one can be mounted (then it can be filled)."""
    root = tmp_path_factory.mktemp("kvmount")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(root)],
                             capture_output=True).returncode == 0
    yield root, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture(scope="module")
def connected(reference: dict, store_mount: tuple[Path, bool]) -> Iterator[VLLMBackend]:
    backend = VLLMBackend(store_dir=store_mount[0] / "store", memory_mb=0)  # disk tier only: corruption is seen
    yield backend
    backend.close()




def _generate(backend: VLLMBackend, ids: list[int], transfer: object = None) -> tuple[list[int], dict, dict]:
    """Greedy ids, first-token logprobs and the connector's report; ``transfer`` goes as is."""
    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, extra_args=extra)
    out = backend.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    first = {tok: lp.logprob for tok, lp in comp.logprobs[0].items()}
    return list(comp.token_ids), first, (out.kv_transfer_params or {}).get("ragfuse")


@pytest.mark.parametrize("transfer", [
    {"ragfuse": {"chunks": "abc"}}, {"ragfuse": {"chunks": [[5, 3]]}}, {"ragfuse": {"chunks": [[-1, 3]]}},
    {"ragfuse": {"chunks": [[0, 5], [4, 8]]}}, {"ragfuse": {"chunks": [[0, 10**6]]}},
    {"ragfuse": {"chunks": [[1.5, 3.7]]}}, {"ragfuse": "x"}, {"ragfuse": {"store_as_chunk": "no"}},
], ids=["str", "reversed", "negative", "overlap", "outside", "float", "params-str", "store-flag-str"])
def test_malformed_marks_are_ignored_and_the_engine_keeps_serving(reference: dict, connected: VLLMBackend,
                                                                  transfer: object) -> None:
    """Before, the ValueError/TypeError was raised inside vLLM's scheduler and every later request
    failed too (the bad one stays queued). Now the marks are ignored: the prompt is served exactly,
    and the report says why."""
    ids = reference["prompts"]["malformed"]
    tokens, _, report = _generate(connected, ids, transfer)
    assert tokens == reference["ids"]["malformed"]
    assert "ignored" in report["error"] and report["chunk_spans"] == 0
    tokens, _, report = _generate(connected, ids)  # the engine is still up
    assert tokens == reference["ids"]["malformed"] and "error" not in report


def test_greedy_output_equals_vllm_alone_for_prefixes_extensions_and_batches(reference: dict,
                                                                             connected: VLLMBackend) -> None:
    """Repeats, strict prefixes (below, at and above one 128-token span), a longer prompt over a stored
    one, and a batch sharing a prefix submitted together (twice: misses, then hits)."""
    prompts, expected = reference["prompts"], reference["ids"]
    store = connected.settings.store_dir
    loaded = {}
    for name in ["fox", "fox", "fox_prefix_200", "fox_prefix_129", "fox_prefix_127", "fox_longer"]:
        tokens, _, report = _generate(connected, prompts[name])
        assert tokens == expected[name], name
        loaded[name] = report["loaded_tokens"]
        wait_saved(store)
    assert loaded == {"fox": 256, "fox_prefix_200": 128, "fox_prefix_129": 128, "fox_prefix_127": 0,
                      "fox_longer": 256}
    names = ["batch_a", "batch_b", "batch_c"]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for round_loaded in (0, 128):
        outs = connected.llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False)
        for name, out in zip(names, outs):
            assert list(out.outputs[0].token_ids) == expected[name], name
            assert out.kv_transfer_params["ragfuse"]["loaded_tokens"] == round_loaded
        wait_saved(store)


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3  # a middle layer: the layers before it load, the ones after do not
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])
    path.write_bytes(bytes(data))


def _same_logprobs(got: dict, want: dict) -> bool:
    """The same top tokens, with logprobs within 1e-4. Float32 (``compute_dtype`` on an AVX2 CPU) is not
    bit-exact across a split prefill: vLLM's own prefix cache, 256 of 456 tokens cached, moves these
    logprobs by 1e-5 against one whole pass. A poisoned span moved them by up to 0.2."""
    return got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in want)


def test_failed_load_neither_poisons_saved_spans_nor_inflates_the_report(reference: dict,
                                                                          connected: VLLMBackend) -> None:
    """A corrupt second span fails mid-load while the same step computes (and saves) the spans after it
    over blocks that were never loaded. Before, that KV was stored under the exact key: a later request
    loaded it and its logprobs moved by up to 0.2; and the report claimed 256 loaded tokens where vLLM
    recomputed all but 128."""
    prompts, settings = reference["prompts"], connected.settings
    _generate(connected, prompts["stored"])
    wait_saved(settings.store_dir)
    span = plan_spans(prompts["stored"], [], settings.fingerprint, settings.kv_dtype, 128)[1]
    _flip_bytes(Path(settings.store_dir) / "data" / span.key[:2] / f"{span.key}.safetensors")

    name = "shares_two_spans"
    tokens, first, report = _generate(connected, prompts[name])
    assert tokens == reference["ids"][name] and _same_logprobs(first, reference["first"][name])
    assert report["loaded_tokens"] == 128  # span 1 loaded; span 2 failed and was recomputed
    wait_saved(settings.store_dir)
    _, _, report = _generate(connected, prompts[name])  # span 2 was dropped: this one stores it again
    wait_saved(settings.store_dir)
    assert report["loaded_tokens"] == 128
    tokens, first, report = _generate(connected, prompts[name])
    assert report["loaded_tokens"] == 384  # spans 1-3, all saved by requests whose loads succeeded
    assert tokens == reference["ids"][name]
    assert _same_logprobs(first, reference["first"][name])  # context spans reload bit-identically


def test_full_disk_does_not_stop_the_engine(reference: dict, connected: VLLMBackend,
                                            store_mount: tuple[Path, bool]) -> None:
    """Before, the save mark's write failed with ENOSPC inside vLLM's scheduler and the engine died."""
    root, mounted = store_mount
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root) to fill a disk")
    name = "disk_full"
    filler = root / "filler"
    try:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            for size in (1 << 20, 4096, 1):  # to the last byte: even a mark of a few bytes cannot be written
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, bytes(size))
        finally:
            os.close(fd)
        tokens, _, report = _generate(connected, reference["prompts"][name])
        assert tokens == reference["ids"][name] and report["saved_spans"] == 0
        assert not any((Path(connected.settings.store_dir) / "pending").iterdir())  # no half-written mark left
    finally:
        filler.unlink(missing_ok=True)
    tokens, _, report = _generate(connected, reference["prompts"][name])
    assert tokens == reference["ids"][name] and report["saved_spans"] > 0  # saves resume once there is room
