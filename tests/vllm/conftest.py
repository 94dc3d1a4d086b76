"""vLLM connector tests: they run under scripts/test_vllm.sh (.venv-vllm); modules that need vLLM skip
themselves with ``pytest.importorskip`` in the main venv, where vLLM cannot be installed."""

import os

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # use both cores of the CI box
