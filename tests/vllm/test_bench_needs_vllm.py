"""In the main venv (no vLLM), ``ragfuse bench vllm`` must fail with one clear line, exit 2."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_bench_vllm_without_vllm_says_how_to_install(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "ragfuse.cli", "bench", "vllm", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "scripts/test_vllm.sh" in r.stderr and "Traceback" not in r.stderr
