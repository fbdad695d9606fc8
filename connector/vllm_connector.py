"""`LedgerConnector(KVConnectorBase_V1)`: translates vLLM's objects into the core's plain-data calls.

The core's only file that imports vllm (beside it: observe mode's adapter,
`observe/adapter.py`, and the Prometheus metrics, `prom.py`). Scheduler-role
instances drive a `SchedulerCore`, worker-role instances a `WorkerCore`; the
clock is read here (`time.time()`) and passed in as `now`. With
`kv_connector_extra_config.observe`, `__new__` hands vLLM an `ObserveConnector`
wrapping the named connector instead. Load with
`--kv-transfer-config '{"kv_connector": "LedgerConnector", "kv_connector_module_path": "kvledger.connector",
"kv_role": "kv_producer", "kv_connector_extra_config": {...}}'`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvledger.connector.assemble import build_scheduler, build_worker
from kvledger.connector.config import ConnectorConfig, from_extra_config
from kvledger.connector.figures import CONTROL_DROPPED, LedgerFigures, dropped_since, merge_figures
from kvledger.connector.groups import flatten_groups, window_blocks
from kvledger.connector.guard import guarded, hook_errors, hooks_over_bound, nothing
from kvledger.connector.hooks import ReceivedKvHook, load_hook
from kvledger.connector.incident_log import IncidentLog
from kvledger.connector.mamba import PREFILL_BACKOFF_TOKENS, MambaGroup, clip_state_blocks, loadable_tokens
from kvledger.connector.metadata import StepMetadata
from kvledger.connector.observe.config import ObserveConfig, ledger_extra, observe_config
from kvledger.connector.observe.names import KVLEDGER, WRAPPED
from kvledger.connector.params import ParamsError, TransferParams, parse_params, prompt_digest, remote_prefill_taken
from kvledger.connector.scheduler import SchedulerCore
from kvledger.connector.worker import WorkerCore
from kvledger.ledger.events import ReqId

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class LedgerHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker rank's generation (`connector/generation.py`): vLLM gathers every worker's after their KV caches
    are registered and hands them to the scheduler half, whose params then name them."""

    generation: int


class LedgerConnectorMetadata(KVConnectorMetadata):
    """One step's `StepMetadata`, carried from the scheduler process to the workers."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


@dataclass
class LedgerStats(KVConnectorStats):
    """The fold's counters (live transfers, blocks held, releases by cause); the latest snapshot wins."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge_figures(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not self.data


def _params(request: Request) -> TransferParams | None:
    try:
        return parse_params(request.kv_transfer_params)
    except ParamsError as error:
        # A malformed request runs without a transfer (a local prefill) rather than failing the engine.
        log.warning("request %s: %s; no KV transfer", request.request_id, error)
        return None


def _prefill_handed_over(request: Request, mode: str) -> bool:
    """Whether a producer request ended in a state where a consumer may use its KV.

    READ: an aborted or failed prefill hands no params to the proxy, so no consumer can ever read
    (holding until defer_timeout would only strand the blocks). WRITE: once the prompt was scheduled,
    the workers may be writing from these blocks, so they are held whatever the status.
    """
    from vllm.v1.request import RequestStatus

    if request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
        return True
    return mode == "write" and request.num_computed_tokens >= request.num_prompt_tokens


def _write_prompt_digest(request: Request, mode: str, params: TransferParams | None, tokens: int) -> str | None:
    """WRITE only (a READ consumer reads the blocks its own params name): what binds the two requests, the
    digest of the `tokens` prompt tokens whose KV moves. A Mamba model's producer prefills its prompt one token
    short (`_truncate_for_prefill`) and its consumer loads as many (`loadable_tokens`): both digest that prefix."""
    if mode != "write" or params is None or request.prompt_token_ids is None:
        return None
    return prompt_digest(request.prompt_token_ids[:tokens])


def _layer_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """Each attention layer's KV cache group (several in hybrid models)."""
    if kv_cache_config is None:
        return {}
    return {name: i for i, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}


def _windows(kv_cache_config: KVCacheConfig | None) -> dict[int, tuple[int, int]]:
    """Each sliding-window KV cache group's (window tokens, block size): what `window_blocks` cuts to."""
    if kv_cache_config is None:
        return {}
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return {
        index: (int(group.kv_cache_spec.sliding_window), int(group.kv_cache_spec.block_size))
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        if isinstance(group.kv_cache_spec, SlidingWindowSpec)
    }


def _mamba_groups(kv_cache_config: KVCacheConfig | None) -> tuple[MambaGroup, ...]:
    """The model's Mamba KV cache groups as plain data (their states move with the attention blocks)."""
    if kv_cache_config is None:
        return ()
    from vllm.v1.kv_cache_interface import MambaSpec

    found = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            found.append(
                MambaGroup(
                    group=index,
                    layers=tuple(group.layer_names),
                    shapes=tuple(tuple(int(d) for d in shape) for shape in spec.shapes),
                    dtypes=tuple(str(dtype).removeprefix("torch.") for dtype in spec.dtypes),
                    page_bytes=int(spec.page_size_bytes),
                    mamba_type=str(getattr(getattr(spec, "mamba_type", ""), "name", "")),
                    speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0)),
                )
            )
    return tuple(found)


_TRUNCATED = "_p_side_truncated"
"""The params key that marks a truncated producer request (NIXL's name: a proxy may see either connector)."""


def _truncate_for_prefill(request: Request, backoff: int) -> None:
    """Producer of a Mamba model: prefill stops `backoff` tokens short of the prompt (the state the
    consumer needs is h(N-1)) and samples one token, as vLLM's NIXL connector does. Once per request:
    the params remember it, so a preempted request is not cut again."""
    params = request.kv_transfer_params
    if (
        not backoff
        or params is None
        or params.get(_TRUNCATED)
        or request.num_prompt_tokens <= backoff
        or request.prompt_token_ids is None
    ):
        return
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    params[_TRUNCATED] = True


def engine_config(vllm_config: VllmConfig, role: KVConnectorRole) -> ConnectorConfig:
    """kvledger's configuration for this process: the extra config (observe mode's `observe` key aside)
    and the engine's place (dp rank, tp rank on a worker). Observe mode's `kv_both` keeps its books as a
    producer's (the role only names the config: a request's own params say which side it is)."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    parallel = vllm_config.parallel_config
    tp_rank = 0
    if role == KVConnectorRole.WORKER:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    extra = transfer.kv_connector_extra_config
    kv_role = str(transfer.kv_role)
    if observe_config(extra) is not None:
        extra, kv_role = ledger_extra(extra), "kv_consumer" if kv_role == "kv_consumer" else "kv_producer"
    return from_extra_config(
        extra,
        kv_role=kv_role,
        engine_id=str(transfer.engine_id),
        dp_rank=parallel.data_parallel_rank,
        dp_size=parallel.data_parallel_size,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
    )


def _observed(vllm_config: VllmConfig) -> ObserveConfig | None:
    transfer = vllm_config.kv_transfer_config
    return observe_config(transfer.kv_connector_extra_config) if transfer is not None else None


def _observed_class(kv_transfer_config: Any) -> type[KVConnectorBase_V1] | None:
    """Observe mode's wrapped connector class, from the engine's KVTransferConfig (class-level hooks)."""
    observe = observe_config(getattr(kv_transfer_config, "kv_connector_extra_config", None))
    if observe is None:
        return None
    from kvledger.connector.observe.adapter import wrapped_class

    return wrapped_class(kv_transfer_config, observe)


class LedgerConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector; `SupportsHMA`: hybrid models' block ids per KV cache group, as NIXL's connector."""

    def __new__(
        cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> LedgerConnector:
        """Observe mode (`kv_connector_extra_config.observe`): vLLM gets an `ObserveConnector` wrapping the
        named connector instead (not a LedgerConnector, so Python does not run `__init__` on it again)."""
        observe = _observed(vllm_config)
        if observe is None:
            return super().__new__(cls)
        from kvledger.connector.observe.adapter import ObserveConnector

        config = engine_config(vllm_config, role)
        return ObserveConnector(  # type: ignore[return-value]
            vllm_config, role, kv_cache_config, config=config, observe=observe
        )

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        self.config = engine_config(vllm_config, role)
        self._mamba = _mamba_groups(kv_cache_config)
        self._state_scratch = {g.group: g.speculative_blocks for g in self._mamba}
        """Each Mamba group's scratch slots: its block lists are cut to the running state (`clip_state_blocks`)."""
        self._windows = _windows(kv_cache_config)
        """Each sliding-window group's window: a WRITE producer's blocks are cut to it (`window_blocks`)."""
        self._backoff = PREFILL_BACKOFF_TOKENS if self._mamba else 0
        """Prompt tokens the producer leaves to the consumer (1 for a Mamba model, as vLLM's NIXL connector)."""
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._layer_groups = _layer_groups(kv_cache_config)
        self._hybrid = kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1
        """More than one KV cache group: vLLM refuses block-level load errors (invalid_block_ids) there;
        a failed load reaches it through failed_recving alone, and it fails or recomputes the request."""
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        self._figures: LedgerFigures | None = None
        self._dropped_reported: Counter[str] = Counter()
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = build_scheduler(self.config)
            ledger = self.scheduler.ledger
            self._figures = LedgerFigures(ledger)
        else:
            self.worker = build_worker(self.config)
            ledger = self.worker.ledger
        self.incident_log = IncidentLog(ledger, self.config.incident_log_dir) if self.config.incident_log_dir else None
        self._bound: KVConnectorMetadata | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._received_hook: ReceivedKvHook | None = None
        """`test_hook_received_kv` (tests only), imported at start so that a wrong name stops the engine."""
        self._recv_blocks: dict[str, tuple[int, ...]] = {}
        """Only with the hook: the blocks each receiving request loads into."""
        if self.worker is not None and self.config.test_hook_received_kv:
            self._received_hook = load_hook(self.config.test_hook_received_kv, "test_hook_received_kv")

    def _sched(self) -> SchedulerCore:
        assert self.scheduler is not None, "a scheduler-side hook called on a worker connector"
        return self.scheduler

    def _work(self) -> WorkerCore:
        assert self.worker is not None, "a worker-side hook called on a scheduler connector"
        return self.worker

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it allows sleep mode (0.32 never does). No: the transports hold the KV
        caches registered at start (mori pins their memory), and a remap at wake-up would leave a peer
        reading or writing the old pages. vLLM then refuses the configuration at start, by name.
        Observe mode answers as the wrapped connector does."""
        wrapped = _observed_class(kv_transfer_config)
        if wrapped is not None and hasattr(wrapped, "supports_sleep_mode"):
            return bool(wrapped.supports_sleep_mode(kv_transfer_config))
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Observe mode: the wrapped connector's layout (NIXL asks for HND on some backends)."""
        wrapped = _observed_class(vllm_config.kv_transfer_config)
        return wrapped.get_required_kvcache_layout(vllm_config) if wrapped is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        observe = observe_config(extra_config)
        if observe is None:
            return False
        from vllm.config.kv_transfer import KVTransferConfig

        engine = KVTransferConfig(kv_connector="LedgerConnector", kv_connector_extra_config=extra_config)
        wrapped = _observed_class(engine)
        return wrapped is not None and wrapped.requires_piecewise_for_cudagraph(observe.wrapped_extra)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """`vllm:kvledger_*` in vLLM's /metrics, in both modes; observe mode adds the wrapped connector's own."""
        from kvledger.connector.prom import LedgerPromMetrics

        wrapped_cls = _observed_class(vllm_config.kv_transfer_config)
        observe = _observed(vllm_config)
        wrapped = None
        if wrapped_cls is not None and observe is not None:
            from kvledger.connector.observe.adapter import wrapped_vllm_config

            temp = wrapped_vllm_config(vllm_config, observe)
            wrapped = wrapped_cls.build_prom_metrics(temp, metric_types, labelnames, per_engine_labelvalues)
        return LedgerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, wrapped=wrapped)

    # -- scheduler side ---------------------------------------------------------

    @guarded(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        loadable = loadable_tokens(request.num_prompt_tokens, self._backoff)
        return self._sched().matched_tokens(_params(request), loadable, num_computed_tokens)

    @guarded(nothing)
    def on_new_request(self, request: Request) -> None:
        # vLLM added the request: a consumer starts renewing its producer's hold (leases) while it waits.
        if self.scheduler is not None:
            params = request.kv_transfer_params
            if self.config.role == "producer" and self._backoff and params and params.get("do_remote_decode"):
                _truncate_for_prefill(request, self._backoff)
            self.scheduler.on_new_request(ReqId(request.request_id), _params(request), time.time())

    @guarded(nothing)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        core, params, now = self._sched(), _params(request), time.time()
        request_id = ReqId(request.request_id)
        if self.config.role == "consumer":
            # Hashed only where on_alloc reads it: an allocation for an external load.
            loaded = loadable_tokens(request.num_prompt_tokens, self._backoff)
            digest = _write_prompt_digest(request, self.config.mode, params, loaded) if num_external_tokens else None
            # Every KV cache group's new blocks (not prefix-cache hits, not null placeholders), as NIXL.
            per_group = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
            block_ids, groups = flatten_groups(clip_state_blocks(per_group, self._state_scratch) if per_group else ())
            taken = core.on_alloc(
                request_id, params, block_ids, num_external_tokens, now, prompt_digest=digest, block_groups=groups
            )
            if taken and request.kv_transfer_params:
                remote_prefill_taken(request.kv_transfer_params)
        elif self.config.mode == "write" and params is not None and params.do_remote_decode:
            # The whole prompt runs in this step (chunked prefill is not supported for WRITE producers yet):
            # every KV cache group's blocks are written, a Mamba group's running state among them (its
            # prompt was cut one token short in on_new_request, as for READ), a window group's that it keeps.
            computed = request.num_prompt_tokens
            digest = _write_prompt_digest(request, self.config.mode, params, computed)
            kept = window_blocks(blocks.get_block_ids(), self._windows, computed)
            flat, groups = flatten_groups(clip_state_blocks(kept, self._state_scratch))
            core.on_save(request_id, params, flat, now, prompt_digest=digest, block_groups=groups)

    @guarded(lambda: LedgerConnectorMetadata(StepMetadata()))
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # The scheduler half's clock tick: vLLM calls this every step of a non-empty engine, while it calls
        # update_connector_output only when a worker reported something (an idle wait would never expire).
        return LedgerConnectorMetadata(self._sched().build_meta(time.time()))

    @guarded(lambda: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    @guarded(lambda: (False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Once per request, with its blocks in every KV cache group: True holds them all until the one
        release the fold decides for the transfer (vLLM frees every group's blocks on finished_sending)."""
        params = _params(request)
        producer = self.config.role == "producer"
        if producer and params is not None and not _prefill_handed_over(request, self.config.mode):
            params = None  # aborted before its KV could reach a consumer: free the blocks now, not at expire
        flat, groups = flatten_groups(clip_state_blocks(block_ids, self._state_scratch))
        return self._sched().on_request_finished(
            ReqId(request.request_id), params, flat, time.time(), block_groups=groups
        )

    @guarded(nothing)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The clock tick: rewrite the workers' report with the fold's decisions (in place, as vLLM allows)."""
        outcome = self._sched().on_worker_output(
            [ReqId(r) for r in connector_output.finished_sending or ()],
            [ReqId(r) for r in connector_output.finished_recving or ()],
            [ReqId(r) for r in connector_output.failed_recving or ()],
            time.time(),
        )
        connector_output.finished_sending = set(outcome.finished_sending) or None
        connector_output.finished_recving = set(outcome.finished_recving) or None
        connector_output.failed_recving = set(outcome.failed_recving)
        if not self._hybrid:
            connector_output.invalid_block_ids = set(connector_output.invalid_block_ids) | outcome.invalid_block_ids
        if self.incident_log is not None:
            self.incident_log.flush()

    @guarded(lambda: False)
    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    @guarded(lambda: False)
    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    @guarded(nothing)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler's fold and figures (it decides); a worker adds only the control messages it dropped."""
        core = self.scheduler
        if core is None:
            worker = self._work()
            dropped = dropped_since({**worker.channel.counters, **worker.counters}, self._dropped_reported)
            return LedgerStats(data={CONTROL_DROPPED: dropped}) if dropped else None
        assert self._figures is not None
        guard = {f"hook_errors_{k}": v for k, v in hook_errors.items()}
        guard.update({f"hooks_over_bound_{k}": v for k, v in hooks_over_bound.items()})
        return LedgerStats(data={**core.stats(), **guard, **self._figures.take(time.time())})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """A stats payload back as stats (vLLM's log aggregates them); observe mode's nests the wrapped one's."""
        data = data or {}
        if KVLEDGER in data or WRAPPED in data:
            from kvledger.connector.observe.adapter import observed_stats_from

            return observed_stats_from(data)
        return LedgerStats(data=data)

    @guarded(nothing)
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' generations by TP rank (vLLM's EngineCore calls this once, at start)."""
        lives = {rank: m.generation for rank, m in metadata.items() if isinstance(m, LedgerHandshakeMetadata)}
        self._sched().set_generations(lives)

    # -- worker side --------------------------------------------------------------

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This rank's generation, for the scheduler half (`set_xfer_handshake_metadata`)."""
        return LedgerHandshakeMetadata(generation=self._work().generation) if self.worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches, self._num_blocks, self._layer_groups, mamba=self._mamba)
        self._kv_caches = dict(kv_caches)

    @guarded(nothing)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if connector_metadata is self._bound:
            return
        self._bound = connector_metadata
        if isinstance(connector_metadata, LedgerConnectorMetadata):
            self._work().bind(connector_metadata.step, time.time())
            if self._received_hook is not None:
                for recv in connector_metadata.step.recv:
                    self._recv_blocks[recv.request_id] = recv.block_ids

    @guarded(nothing)
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load(time.time())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits for finished_recving, not for a layer

    @guarded(nothing)
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._work().save_layer(layer_name)

    @guarded(nothing)
    def wait_for_save(self) -> None:
        self._work().wait_for_save(time.time())

    def _worker_finished(self, finished_req_ids: set[str]) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        sending, recving, failed = self._work().get_finished([ReqId(r) for r in finished_req_ids], time.time())
        if self._received_hook is not None:
            self._call_received_hook(self._received_hook, recving - failed)
        if self.incident_log is not None:
            self.incident_log.flush()
        return sending, recving, failed

    def _call_received_hook(self, hook: ReceivedKvHook, received: set[ReqId]) -> None:
        blocks = [b for r in received for b in self._recv_blocks.pop(r, ())]
        if blocks:
            axes = {name: layer.geometry.block_axis for name, layer in self._work().layers.items()}
            touched = hook(self._kv_caches, axes, blocks)
            log.warning(
                "test_hook_received_kv %s: touched %d received blocks", self.config.test_hook_received_kv, touched
            )

    @guarded(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, failed = self._worker_finished(finished_req_ids)
        del failed  # carried by get_transfer_results, which vLLM calls instead when present
        return (set(sending) or None), (set(recving) or None)

    @guarded(KVConnectorTransferResults)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending), finished_recving=set(recving), failed_recving=set(failed)
        )

    @guarded(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._work().take_load_errors()
        return set() if self._hybrid else errors  # hybrid: failed_recving names the request instead

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.incident_log is not None:
            self.incident_log.close()
        if self.scheduler is not None:
            self.scheduler.ledger.close()  # flush this process's events to the store
