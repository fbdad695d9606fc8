"""Shared by every test: the vLLM version guard for runs on another vLLM than site-packages'."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def expected_vllm() -> None:
    """scripts/test_vllm033.sh puts vLLM 0.33 first on PYTHONPATH: every test fails if another one loaded."""
    wanted = os.environ.get("KVLEDGER_EXPECT_VLLM")
    if wanted:
        import vllm

        assert vllm.__version__ == wanted, f"vLLM {vllm.__version__} from {vllm.__file__}, not {wanted}"
