"""Fixtures shared by the end-to-end tests: the tiny model folder, made here (no download)."""

from __future__ import annotations

import pytest

from tests.e2e.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))
