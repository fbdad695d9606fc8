"""The order in which vLLM's engine calls the connector's hooks within one step, as data.

`SimEngine.step` documents where each phase comes from in vLLM's code; this is the same order in the
names of the connector's cores (`SchedulerCore`, `WorkerCore`), which `LedgerConnector` calls one for
one from vLLM's hooks. A step's calls follow vLLM's order when, repeats of a phase merged, they are a
subsequence of `STEP_PHASES`.
"""

from __future__ import annotations

from collections.abc import Iterable

STEP_PHASES: tuple[frozenset[str], ...] = (
    # add_request (on_new_request) and schedule(): per request get_num_new_matched_tokens, then
    # update_state_after_alloc (a consumer's on_alloc, a WRITE producer's on_save); has_pending_block_frees
    # when an allocation fails. Interleaved across requests, so one phase.
    frozenset({"on_new_request", "matched_tokens", "on_alloc", "on_save", "has_pending_block_frees"}),
    frozenset({"build_meta"}),  # build_connector_meta, last in schedule()
    frozenset({"bind"}),  # bind_connector_metadata
    frozenset({"start_load"}),  # start_load_kv before the forward: synchronous loads only
    frozenset({"save_layer"}),  # save_kv_layer, per layer during the forward
    frozenset({"start_load"}),  # start_load_kv right after launching the forward: asynchronous loads
    frozenset({"wait_for_save"}),
    frozenset({"get_finished"}),  # get_finished / get_transfer_results
    frozenset({"take_load_errors"}),  # get_block_ids_with_load_errors
    frozenset({"on_request_finished"}),  # update_from_output: requests that stopped (_free_request)
    frozenset({"on_worker_output"}),  # update_from_output: _update_from_kv_xfer_finished
    frozenset({"stats"}),  # update_from_output: get_kv_connector_stats
)

HOOK_NAMES: frozenset[str] = frozenset().union(*STEP_PHASES)


def phases(calls: Iterable[str]) -> list[str]:
    """The calls with repeats merged: one entry per run of calls in the same phase (the schedule phase is
    named by its first call's phase, `schedule`)."""
    out: list[str] = []
    for name in calls:
        label = "schedule" if name in STEP_PHASES[0] else name
        if not out or out[-1] != label:
            out.append(label)
    return out


def in_step_order(calls: Iterable[str]) -> bool:
    """Whether one step's hook calls come in vLLM's order (every name must be one of `HOOK_NAMES`)."""
    position = 0
    for label in phases(calls):
        while position < len(STEP_PHASES) and not _matches(label, STEP_PHASES[position]):
            position += 1
        if position == len(STEP_PHASES):
            return False
        position += 1
    return True


def _matches(label: str, phase: frozenset[str]) -> bool:
    return phase is STEP_PHASES[0] if label == "schedule" else label in phase
