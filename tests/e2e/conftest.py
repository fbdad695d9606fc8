"""Fixtures shared by the end-to-end tests: the tiny model folder, made here (no download)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The scheduler contract tests' model folder (only its config.json is read)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's clock replaced by a `sched_harness.Clock` that the test moves."""
    import kvledger.connector.vllm_connector as adapter
    from tests.e2e.sched_harness import Clock

    fake = Clock()
    monkeypatch.setattr(adapter.time, "time", fake)
    return fake
