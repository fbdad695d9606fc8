"""Failures the scheduler half decides, and deadlines, reach vLLM's real `Scheduler` in time.

vLLM reads `failed_recving` and `invalid_block_ids` at the top of `update_from_output`, before it calls
`update_connector_output`, and calls that only when a worker reported something. So here the workers'
report is not written by hand: a real `WorkerCore` (real ZMQ on loopback, the tcp transport) gets each
step's metadata and its `get_finished` / load errors become the step's `KVConnectorOutput`, absent when
empty on a step that ran nothing (as vLLM's no-forward path does). The producer is dead (nothing listens
on its ports): the consumer's handshake runs its timeout out on the linker's thread, never in a hook.
Each case runs for both `kv_load_failure_policy` values, on an idle engine and beside a running request,
and asserts the request's final status and how many tokens vLLM recomputed.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvledger.connector.assemble import build_worker
from kvledger.connector.metadata import PeerRef
from kvledger.connector.params import consumer_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.reasons import REASON_PEER_UNLINKED
from kvledger.connector.worker import WorkerCore
from kvledger.ledger.events import Fail, ReqId
from tests.e2e.sched_harness import BLOCK_SIZE, NUM_BLOCKS, assert_empty, make_request, make_scheduler, make_vllm_config
from tests.e2e.tiny_model import write_tiny_model

PROMPT_TOKENS = 40  # three 16-token blocks
TRANSFER_TIMEOUT_S = 30.0
STEPS_MAX = 64


class Engine:
    """vLLM's Scheduler plus one worker half, stepped in vLLM's order on a hand-moved clock."""

    def __init__(self, model: str, policy: str, monkeypatch: pytest.MonkeyPatch, **timeouts: float) -> None:
        import kvledger.connector.vllm_connector as adapter

        self.now = 1_000_000.0
        monkeypatch.setattr(adapter.time, "time", lambda: self.now)  # type: ignore[attr-defined]
        mine, producer = free_loopback_ports(3), free_loopback_ports(3)
        self.producer_ports = {"handshake_port": producer[0], "notify_port": producer[1], "transport_port": producer[2]}
        extra = {
            "read_mode": True,
            "handshake_port": mine[0],
            "notify_port": mine[1],
            "transport_port": mine[2],
            "transfer_timeout": TRANSFER_TIMEOUT_S,
            "peers": [{"host": "127.0.0.1", **self.producer_ports}],
            **timeouts,
        }
        self.scheduler = make_scheduler(make_vllm_config(model, "kv_consumer", extra, kv_load_failure_policy=policy))
        self.worker: WorkerCore = build_worker(self.scheduler.connector.config)
        self.worker.register_kv_caches({"layer": torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 1, 1)}, NUM_BLOCKS)
        self.scheduled: dict[str, list[int]] = {}
        """Tokens vLLM scheduled per request, step by step."""

    def close(self) -> None:
        self.worker.close()

    def params(self, tid: str, *, notify_port: int | None = None) -> dict[str, Any]:
        return consumer_params(
            tid,  # type: ignore[arg-type]
            (5, 6, 7),
            PeerRef(
                engine_id="prefill-0",
                host="127.0.0.1",
                handshake_port=self.producer_ports["handshake_port"],
                notify_port=notify_port or self.producer_ports["notify_port"],
            ),
        )

    def step(self) -> tuple[Any, Any]:
        out = self.scheduler.schedule()
        worker, now = self.worker, self.now
        worker.bind(out.kv_connector_metadata.step, now)
        worker.start_load(now)
        worker.wait_for_save(now)
        sending, recving, failed = worker.get_finished([ReqId(r) for r in out.finished_req_ids], now)
        report = KVConnectorOutput(
            finished_sending=set(sending) or None,
            finished_recving=set(recving) or None,
            failed_recving=set(failed),
            invalid_block_ids=worker.take_load_errors(),
        )
        ran = [r for r in out.num_scheduled_tokens if r in self.scheduler.requests]
        for r, n in out.num_scheduled_tokens.items():
            self.scheduled.setdefault(r, []).append(n)
        output = ModelRunnerOutput(
            req_ids=ran,
            req_id_to_index={r: i for i, r in enumerate(ran)},
            sampled_token_ids=[[7] for _ in ran],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=None if report.is_empty() and not ran else report,
        )
        return out, self.scheduler.update_from_output(out, output)

    def run_until_done(self, request: Request) -> None:
        for _ in range(STEPS_MAX):
            if request.is_finished():
                return
            self.step()
        raise AssertionError(f"{request.request_id} still {request.status} after {STEPS_MAX} steps")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def _other_request(engine: Engine, busy: bool) -> Request | None:
    if not busy:
        return None
    other = make_request(20, None, max_tokens=STEPS_MAX)
    engine.scheduler.add_request(other)
    return other


def _expect_policy_outcome(engine: Engine, request: Request, policy: str) -> None:
    """fail: the request ends with an error, nothing decoded; recompute: the whole prompt is computed
    locally (none of the failed load trusted), then it decodes to its length."""
    engine.run_until_done(request)
    counts = engine.scheduled.get(request.request_id, [])
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert counts == []
    else:
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert counts[0] == PROMPT_TOKENS and sum(counts) == PROMPT_TOKENS + request.max_tokens - 1


def _finish(engine: Engine, other: Request | None) -> None:
    if other is not None:
        engine.scheduler.finish_requests(other.request_id, RequestStatus.FINISHED_ABORTED)
    for _ in range(4):
        engine.step()
    assert_empty(engine.scheduler)
    engine.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_dead_producer_fails_the_load_by_the_transfer_timeout(
    model: str, monkeypatch: pytest.MonkeyPatch, policy: str, busy: bool
) -> None:
    engine = Engine(model, policy, monkeypatch)
    other = _other_request(engine, busy)
    request = make_request(PROMPT_TOKENS, engine.params(f"tx-dead-{policy}-{busy}"), max_tokens=2)
    engine.scheduler.add_request(request)
    for _ in range(3):  # the handshake is under way (or failed, and retried): the request waits, unloaded
        engine.now += 1.0
        engine.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.now += TRANSFER_TIMEOUT_S
    _expect_policy_outcome(engine, request, policy)
    fails = [e for e in engine.worker.ledger.log.since() if isinstance(e, Fail)]
    assert [f.reason.split(":")[0] for f in fails] == [REASON_PEER_UNLINKED]
    assert f"127.0.0.1:{engine.producer_ports['handshake_port']}" in fails[0].reason
    _finish(engine, other)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_recv_deadline_fires_on_the_scheduler_tick_and_reaches_vllm_through_the_worker(
    model: str, monkeypatch: pytest.MonkeyPatch, policy: str, busy: bool
) -> None:
    engine = Engine(model, policy, monkeypatch, recv_abort_timeout=10.0)
    other = _other_request(engine, busy)
    request = make_request(PROMPT_TOKENS, engine.params(f"tx-deadline-{policy}-{busy}"), max_tokens=2)
    engine.scheduler.add_request(request)
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.now += 11.0  # past the recv deadline, well within the transfer timeout
    _expect_policy_outcome(engine, request, policy)
    fails = [e for e in engine.worker.ledger.log.since() if isinstance(e, Fail)]
    # The scheduler's tick (build_connector_meta) decided it and handed it to the worker in the metadata.
    assert [f.reason.split(":")[0] for f in fails] == ["scheduler"] and "expired" in fails[0].reason
    _finish(engine, other)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_outside_the_allow_list_means_a_local_prefill(
    model: str, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    engine = Engine(model, policy, monkeypatch)
    stranger = engine.producer_ports["notify_port"] + 1
    request = make_request(PROMPT_TOKENS, engine.params("tx-stranger", notify_port=stranger), max_tokens=2)
    engine.scheduler.add_request(request)
    out, _ = engine.step()
    assert out.num_scheduled_tokens == {request.request_id: PROMPT_TOKENS}  # never waits for remote KV
    engine.run_until_done(request)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sum(engine.scheduled[request.request_id]) == PROMPT_TOKENS + 1
    assert not [e for e in engine.worker.ledger.log.since() if isinstance(e, Fail)]
    _finish(engine, None)
