"""Observe mode around vLLM's Mooncake connector, scheduler side, under vLLM's real `Scheduler`: its transfer id
is the router's `transfer_id` on both sides (the Mooncake worker, which needs the `mooncake` transfer engine,
does not run here: its reports are handed in as it makes them)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvledger.cli.app import app
from kvledger.ledger.events import kind_of
from tests.e2e.sched_harness import NUM_BLOCKS, Clock, free_blocks, make_request, make_scheduler, make_vllm_config, step

pytestmark = pytest.mark.vllm


def test_mooncake_transfers_are_recorded_once_on_each_side(model: str, tmp_path: Path, clock: Clock) -> None:
    extra: dict[str, Any] = {"incident_log_dir": str(tmp_path), "observe": {"kv_connector": "MooncakeConnector"}}
    producer = make_scheduler(make_vllm_config(model, "kv_producer", extra))
    consumer = make_scheduler(make_vllm_config(model, "kv_consumer", extra))
    tid = f"tx-{uuid.uuid4().hex}"
    prefill = make_request(40, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    producer.add_request(prefill)
    step(producer)
    assert free_blocks(producer) < NUM_BLOCKS - 1  # Mooncake delayed the free
    params = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "prefill-0",
              "remote_bootstrap_addr": "127.0.0.1:1"}  # fmt: skip
    decode = make_request(40, params, max_tokens=3)
    consumer.add_request(decode)
    step(consumer)  # (40, True): waits for its remote KV
    clock.now += 1
    step(consumer, finished_recving={decode.request_id})
    step(producer, finished_sending={prefill.request_id})
    assert free_blocks(producer) == NUM_BLOCKS - 1
    for _ in range(3):
        step(consumer)
    producer.connector.shutdown()
    consumer.connector.shutdown()
    for scheduler in (producer, consumer):
        events = [(kind_of(e), e.transfer_id) for e in scheduler.connector.recorder.ledger.log.since(0)]
        assert events == [("map", tid), ("ack", tid)]
    report = CliRunner().invoke(app, ["audit", *map(str, sorted(tmp_path.glob("*.jsonl")))])
    assert "no findings" in report.output, report.output
