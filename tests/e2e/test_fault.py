"""A consumer killed mid-transfer: the producer's blocks come back by expire and the producer keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import allocate_ports, consumer_side, engines, ledger_extra, ledger_transfer_config, prompts
from tests.e2e.ledger_check import fold_logs

pytestmark = pytest.mark.vllm

DEFER_TIMEOUT_S = 4.0
"""Short, so that the test waits seconds for the expire; the drain below allows far longer."""


def test_killed_consumer_blocks_expire_and_producer_serves(tiny_model: str, tmp_path: Path) -> None:
    pp, cp = allocate_ports()
    logs = tmp_path / "logs"
    producer_extra = ledger_extra("read", pp, cp, logs, defer_timeout=DEFER_TIMEOUT_S)
    producer_spec = {
        "model": tiny_model,
        "kv_transfer_config": ledger_transfer_config("kv_producer", "prefill-0", producer_extra),
    }
    consumer_spec = {
        "model": tiny_model,
        "kv_transfer_config": ledger_transfer_config("kv_consumer", "decode-0", ledger_extra("read", cp, pp, logs)),
    }
    batch = prompts(3)
    with engines(("prefill", producer_spec), ("decode", consumer_spec)) as (p, c):
        plain = [o["tokens"] for o in p.generate([{"prompt": x, "max_tokens": 8} for x in batch])]
        prefilled = p.generate(
            [
                {
                    "prompt": x,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"tx-f{i}"},
                }
                for i, x in enumerate(batch)
            ]
        )
        # The first two go to the consumer, which dies while it takes them; the third never reaches it
        # (as if the proxy died too), so at least that one can only come back by expire.
        c.send(
            {
                "op": "generate",
                "requests": [
                    {"prompt": x, "max_tokens": 8, "kv_transfer_params": consumer_side(o["kv_transfer_params"])}
                    for x, o in zip(batch[:2], prefilled[:2], strict=True)
                ],
            }
        )
        c.kill()
        drained = p.call({"op": "drain", "timeout_s": 120})
        assert drained["idle"], drained
        assert drained["connector"]["live"] == 0 and drained["connector"]["blocks_held"] == 0
        again = [o["tokens"] for o in p.generate([{"prompt": x, "max_tokens": 8} for x in batch])]
        assert again == plain

    producer = fold_logs(logs, only="prefill-0")
    per_side = producer.releases_per_side()
    assert set(per_side) == producer.mapped_sides() and set(per_side.values()) == {1}
    assert not producer.state.live
    assert producer.causes("prefill-0")["expired"] >= 2  # scheduler and worker side of tx-f2 at least
    for release in producer.releases:
        t = producer.state.transfers[(release.source, release.transfer_id)]
        assert release.cause in ("completed", "expired")
        if release.cause == "expired":
            assert t.deadline is not None and release.ts >= t.deadline  # never before defer_timeout
    assert [f for f in producer.findings if f.severity == "error"] == []
    merged = fold_logs(logs)  # with whatever the killed consumer had flushed
    assert [f for f in merged.findings if f.code == "premature_release"] == []
