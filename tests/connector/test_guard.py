"""Every vLLM hook sits behind the guard: an exception inside becomes a log line and a count, never vLLM's."""

from __future__ import annotations

import logging

import pytest

from kvledger.connector import guard

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "has_pending_block_frees",
    "has_pending_push_work",
    "bind_connector_metadata",
    "start_load_kv",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
)


def test_a_raising_hook_returns_its_neutral_answer_logs_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    @guard.guarded(lambda: (0, False))
    def get_num_new_matched_tokens(request: object) -> tuple[int, bool]:
        raise KeyError("a bug")

    before = guard.hook_errors["get_num_new_matched_tokens"]
    with caplog.at_level(logging.ERROR, logger="kvledger.connector.guard"):
        assert get_num_new_matched_tokens(object()) == (0, False)
    assert guard.hook_errors["get_num_new_matched_tokens"] == before + 1
    assert any("get_num_new_matched_tokens" in r.getMessage() for r in caplog.records)


def test_a_hook_that_does_not_raise_answers_as_it_would() -> None:
    @guard.guarded(guard.nothing)
    def hook(x: int) -> int:
        return x * 2

    assert hook(21) == 42


def test_every_vllm_hook_of_the_connector_is_guarded() -> None:
    pytest.importorskip("vllm")
    from kvledger.connector.vllm_connector import LedgerConnector

    unguarded = [name for name in HOOKS if not hasattr(getattr(LedgerConnector, name), "__wrapped__")]
    assert unguarded == []


def test_a_hook_slower_than_the_bound_is_counted() -> None:
    import time

    from kvledger.connector.limits import HOOK_CALL_BOUND_S

    @guard.guarded(guard.nothing)
    def wait_for_save() -> None:
        time.sleep(2 * HOOK_CALL_BOUND_S)  # what a hook must never do: wait

    before = guard.hooks_over_bound["wait_for_save"]
    wait_for_save()
    assert guard.hooks_over_bound["wait_for_save"] == before + 1
