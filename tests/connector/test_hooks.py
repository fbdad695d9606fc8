"""Test hooks plug in by name from the tests (`test_hook_received_kv`); the connector never imports tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvledger.connector.config import ConfigError, from_extra_config
from kvledger.connector.hooks import load_hook
from tests.e2e.hooks import CORRUPT_RECEIVED_KV, corrupt_blocks

CONNECTOR = Path(__file__).resolve().parents[2] / "connector"


def test_the_hook_is_named_in_the_config_and_imported_by_that_name() -> None:
    config = from_extra_config({"test_hook_received_kv": CORRUPT_RECEIVED_KV}, kv_role="kv_consumer", engine_id="d")
    assert config.test_hook_received_kv == "tests.e2e.hooks:corrupt_blocks"
    assert load_hook(config.test_hook_received_kv, "test_hook_received_kv") is corrupt_blocks
    assert from_extra_config({}, kv_role="kv_consumer", engine_id="d").test_hook_received_kv is None


@pytest.mark.parametrize("value", ["tests.e2e.hooks", "tests.e2e.hooks:", ":corrupt_blocks", "a..b:f", 1, True])
def test_a_malformed_hook_name_is_refused_at_start(value: object) -> None:
    with pytest.raises(ConfigError, match="test_hook_received_kv"):
        from_extra_config({"test_hook_received_kv": value}, kv_role="kv_consumer", engine_id="d")


@pytest.mark.parametrize(
    "path", ["tests.e2e.no_such_module:f", "tests.e2e.hooks:no_such_hook", "tests.e2e.hooks:NOISE_SCALE"]
)
def test_a_hook_that_cannot_be_imported_or_called_is_a_config_error(path: str) -> None:
    with pytest.raises(ConfigError, match="test_hook_received_kv"):
        load_hook(path, "test_hook_received_kv")


def test_the_old_boolean_key_is_gone() -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        from_extra_config({"test_hook_corrupt_received_kv": True}, kv_role="kv_consumer", engine_id="d")


def test_corrupt_blocks_overwrites_the_named_blocks_only() -> None:
    cache = torch.zeros(2, 4, 3, 1)  # (k/v, blocks, tokens, heads): blocks on axis 1
    touched = corrupt_blocks({"layer": cache}, {"layer": 1}, [2, 0, 2])
    assert touched == 2
    assert cache[:, 0].abs().sum() > 0 and cache[:, 2].abs().sum() > 0
    assert cache[:, 1].abs().sum() == 0 and cache[:, 3].abs().sum() == 0


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
    return names


def test_nothing_under_connector_imports_the_tests() -> None:
    files = sorted(CONNECTOR.rglob("*.py"))
    assert len(files) > 20  # the walk found the package
    offenders = {
        str(f.relative_to(CONNECTOR)): name
        for f in files
        for name in _imports(f)
        if name == "tests" or name.startswith("tests.")
    }
    assert offenders == {}
