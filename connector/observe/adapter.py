"""`ObserveConnector`: vLLM's KV connector interface delegated, unchanged, to the connector it wraps.

The second file under `connector/` that imports vllm (beside `vllm_connector.py`,
whose `LedgerConnector` builds this when `kv_connector_extra_config.observe` is
set). The wrapped connector is built by vLLM's own factory, as MultiConnector
builds its children; every `KVConnectorBase_V1` call goes to it and its answer
goes back to vLLM untouched. Scheduler-side calls are then shown to the
`Recorder` in steps behind `connector/guard.py`'s guard, as every hook of the
connector's own mode is: a recording problem is logged and counted
(`hook_errors`, in the stats), the wrapped connector's answer has already gone
back and serving goes on. The delegation itself is not guarded: what the wrapped
connector raises reaches vLLM exactly as it would without the observer.
The worker side records nothing: what its workers finish reaches the scheduler
in `KVConnectorOutput`, and one process (`<engine>/sched`) keeps the books.

Stats are the one place the wrapper adds to an answer: `get_kv_connector_stats`
returns `ObservedStats` holding the wrapped connector's stats unchanged beside
the ledger's figures (as MultiConnector nests its children's), and the
Prometheus side hands the wrapped part to the wrapped connector's own metrics.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.figures import LedgerFigures, merge_figures
from kvledger.connector.groups import flatten_groups
from kvledger.connector.guard import guarded, hook_errors, hooks_over_bound, nothing
from kvledger.connector.incident_log import IncidentLog
from kvledger.connector.observe.config import ObserveConfig
from kvledger.connector.observe.names import KVLEDGER, WRAPPED, WRAPPED_CONNECTOR
from kvledger.connector.observe.recorder import Recorder
from kvledger.connector.store import abandon_inherited, open_ledger
from kvledger.ledger.events import ReqId

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def wrapped_transfer_config(outer: Any, observe: ObserveConfig) -> KVTransferConfig:
    """The wrapped connector's KVTransferConfig: the engine's fields, overridden by what `observe` gives."""
    inherited = {
        "engine_id": getattr(outer, "engine_id", None),
        "kv_role": getattr(outer, "kv_role", None) or "kv_both",
        "kv_buffer_device": getattr(outer, "kv_buffer_device", "cuda"),
        "kv_load_failure_policy": getattr(outer, "kv_load_failure_policy", "fail"),
    }
    return KVTransferConfig(**{**inherited, **observe.wrapped})


def wrapped_vllm_config(vllm_config: VllmConfig, observe: ObserveConfig) -> VllmConfig:
    """The engine's config with the wrapped connector's KVTransferConfig, as MultiConnector makes its children's."""
    temp = copy.copy(vllm_config)
    temp.kv_transfer_config = wrapped_transfer_config(vllm_config.kv_transfer_config, observe)
    return temp


def wrapped_class(outer: Any, observe: ObserveConfig) -> type[KVConnectorBase_V1]:
    """The wrapped connector's class, resolved by vLLM's factory from the engine's KVTransferConfig `outer`."""
    cls = KVConnectorFactory.get_connector_class(wrapped_transfer_config(outer, observe))
    assert issubclass(cls, KVConnectorBase_V1), f"{cls.__name__} is not a v1 KV connector"
    return cls


@dataclass
class ObservedStats(KVConnectorStats):
    """`{"wrapped": the wrapped connector's stats, "kvledger": the ledger's figures}`; each aggregates as its own."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, KVConnectorStats) else v) for k, v in self.data.items()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if isinstance(mine, KVConnectorStats) and isinstance(value, KVConnectorStats):
                self.data[key] = mine.aggregate(value)
            elif key == KVLEDGER and isinstance(mine, dict) and isinstance(value, dict):
                self.data[key] = merge_figures(mine, value)
            elif value is not None:
                self.data[key] = value
        return self

    def reset(self) -> None:
        for value in self.data.values():
            if isinstance(value, KVConnectorStats):
                value.reset()  # type: ignore[no-untyped-call]
        self.data.pop(KVLEDGER, None)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        wrapped = self.data.get(WRAPPED)
        if isinstance(wrapped, KVConnectorStats):
            out.update(wrapped.reduce())
        figures = self.data.get(KVLEDGER) or {}
        out.update({f"kvledger_{k}": v for k, v in figures.items() if isinstance(v, int | float)})
        return out

    def is_empty(self) -> bool:
        wrapped = self.data.get(WRAPPED)
        return not self.data.get(KVLEDGER) and (not isinstance(wrapped, KVConnectorStats) or wrapped.is_empty())


def observed_stats_from(data: dict[str, Any]) -> ObservedStats:
    """A payload (`to_dict`) back as stats: the wrapped part through its connector's own
    `build_kv_connector_stats`, found by its registered name (as MultiConnector rebuilds its children's)."""
    out = dict(data)
    wrapped, name = data.get(WRAPPED), data.get(WRAPPED_CONNECTOR)
    if isinstance(wrapped, dict) and isinstance(name, str):
        try:
            cls = KVConnectorFactory.get_connector_class_by_name(name)
            out[WRAPPED] = cls.build_kv_connector_stats(data=wrapped)
        except ValueError:
            out[WRAPPED] = None  # not a registered connector: its stats are logged by its metrics only
    return ObservedStats(data=out)


def _finished_normally(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _expired_reported(stats: KVConnectorStats | None, stat: str | None) -> int | None:
    """How many requests the wrapped connector says it freed by timeout in this output (its own stats)."""
    if stat is None:
        return None
    data = stats.data if stats is not None else {}
    inner = data.get(WRAPPED)
    if isinstance(inner, KVConnectorStats):
        data = inner.data
    value = data.get(stat, 0)
    return len(value) if isinstance(value, list) else int(value or 0)


class ObserveConnector(KVConnectorBase_V1, SupportsHMA):
    """The wrapped connector keeps every decision; this records what passes through."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
        *,
        config: ConnectorConfig,
        observe: ObserveConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        self.config = config
        self.observe_config = observe
        temp = wrapped_vllm_config(vllm_config, observe)
        cls = wrapped_class(vllm_config.kv_transfer_config, observe)
        groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if groups > 1 and not issubclass(cls, SupportsHMA):
            # Refused at start, by name, as vLLM refuses such a connector itself: hybrid models' blocks come
            # per KV cache group, which this connector cannot take.
            raise ValueError(f"LedgerConnector observe mode: {cls.__name__} does not support hybrid models (HMA)")
        self.wrapped: KVConnectorBase_V1 = cls(temp, role, kv_cache_config)  # type: ignore[arg-type]
        self.recorder: Recorder | None = None
        self.figures: LedgerFigures | None = None
        self.incident_log: IncidentLog | None = None
        if role == KVConnectorRole.SCHEDULER:
            ledger = open_ledger(config, config.source(scheduler=True))
            abandon_inherited(ledger)  # reopened after a restart: those requests died with the process
            self.recorder = Recorder(
                ledger, observe.keys, hold_s=observe.hold_s, transfer_timeout_s=config.transfer_timeout_s
            )
            self.figures = LedgerFigures(ledger)
            if config.incident_log_dir:
                self.incident_log = IncidentLog(ledger, config.incident_log_dir)
        log.info("kvledger observes %s (%s)", type(self.wrapped).__name__, role.name)

    # -- properties vLLM reads ------------------------------------------------

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.wrapped.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self.wrapped.requires_kv_delivery

    # -- scheduler side: delegated, then recorded -----------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.wrapped.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        before = dict(request.kv_transfer_params) if request.kv_transfer_params else None
        self.wrapped.update_state_after_alloc(request, blocks, num_external_tokens)
        self._after_alloc(request, blocks, num_external_tokens, before)

    @guarded(nothing)
    def _after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int, before: dict[str, Any] | None
    ) -> None:
        if self.recorder is None or num_external_tokens <= 0:
            return
        block_ids, groups = flatten_groups(blocks.get_unhashed_block_ids_all_groups())
        self.recorder.on_alloc(ReqId(request.request_id), before, block_ids, groups, num_external_tokens, time.time())

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.wrapped.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        before = dict(request.kv_transfer_params) if request.kv_transfer_params else None
        answer = self.wrapped.request_finished(request, block_ids)
        self._after_finished(request, (block_ids,), answer[0], before)
        return answer

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        before = dict(request.kv_transfer_params) if request.kv_transfer_params else None
        if supports_hma(self.wrapped):
            answer = self.wrapped.request_finished_all_groups(request, block_ids)  # type: ignore[attr-defined]
        else:
            answer = self.wrapped.request_finished(request, block_ids[0])
        self._after_finished(request, block_ids, answer[0], before)
        return answer  # type: ignore[no-any-return]

    @guarded(nothing)
    def _after_finished(
        self, request: Request, block_ids: tuple[list[int], ...], delayed: bool, before: dict[str, Any] | None
    ) -> None:
        if self.recorder is None:
            return
        flat, groups = flatten_groups(block_ids)
        self.recorder.on_request_finished(
            ReqId(request.request_id), before, _finished_normally(request), delayed, flat, groups, time.time()
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.wrapped.update_connector_output(connector_output)
        self._after_output(connector_output)

    @guarded(nothing)
    def _after_output(self, out: KVConnectorOutput) -> None:
        if self.recorder is None:
            return
        self.recorder.on_output(
            out.finished_sending or (),
            out.finished_recving or (),
            out.failed_recving or (),
            out.invalid_block_ids or (),
            _expired_reported(out.kv_connector_stats, self.observe_config.keys.expired_stat),
            time.time(),
        )
        if self.incident_log is not None:
            self.incident_log.flush()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        wrapped = self.wrapped.get_kv_connector_stats()
        figures = self._figures()
        if wrapped is None and figures is None:
            return None
        name = self.observe_config.keys.connector
        return ObservedStats(data={WRAPPED: wrapped, KVLEDGER: figures, WRAPPED_CONNECTOR: name})

    @guarded(nothing)
    def _figures(self) -> dict[str, Any] | None:
        if self.recorder is None or self.figures is None:
            return None
        counts = {f"count_{k}": v for k, v in self.recorder.counters.items()}
        guard = {f"hook_errors_{k}": v for k, v in hook_errors.items()}
        guard.update({f"hooks_over_bound_{k}": v for k, v in hooks_over_bound.items()})
        return {**self.figures.take(time.time()), **counts, **guard}

    # -- worker side: delegated ------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.wrapped.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.wrapped.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.wrapped.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.wrapped.wait_for_save()  # type: ignore[no-untyped-call]

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.wrapped.get_transfer_results(finished_req_ids)

    def shutdown(self) -> None:
        try:
            self.wrapped.shutdown()  # type: ignore[no-untyped-call]
        finally:
            self._close()

    @guarded(nothing)
    def _close(self) -> None:
        if self.incident_log is not None:
            self.incident_log.close()
        if self.recorder is not None:
            self.recorder.ledger.close()


DELEGATED = (
    "get_mem_pool_context",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "has_connector_metadata",
    "_get_connector_metadata",
    "register_kv_caches",
    "unregister_kv_caches",
    "restore_kv_caches",
    "set_host_xfer_buffer_ops",
    "finish_forward",
    "reset_capture_state",
    "handle_preemptions",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "get_handshake_metadata",
    "build_connector_worker_meta",
    "bind_kv_cache_manager",
    "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "on_new_request",
    "register_finished_partial_tail",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_finished_count",
    "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware",
    "reset_cache",
)
"""Instance methods passed straight through (arguments and answers untouched). A test holds that every
public method of vLLM's `KVConnectorBase_V1` is here or defined above."""


def _delegate(name: str) -> Callable[..., Any]:
    def call(self: ObserveConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.wrapped, name)(*args, **kwargs)

    call.__name__ = name
    return call


for _name in DELEGATED:
    if hasattr(KVConnectorBase_V1, _name):  # vLLM 0.32 and 0.33 differ by a few hooks
        setattr(ObserveConnector, _name, _delegate(_name))
