"""A decode that reads after the producer's deadline, in two real CPU engines: the producer has let the
transfer go and reused its blocks for other requests, so its transport refuses the read; the consumer
reports a load error, vLLM recomputes (kv_load_failure_policy "recompute") and the answer is the plain
run's, token for token — never tokens decoded from another request's KV.

The negative control was run by hand (the refusal switched off in `ConnectorConfig`): the consumer then
reports the late read as received and the ledger assertions below fail. Its tokens still equaled the plain
run's there (vLLM's free-block queue had not handed the released blocks to the other traffic yet, or the
dummy weights decode the same from either KV), so the token equality alone does not discriminate; the
ledger's account of the read (refused, recomputed) does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import allocate_ports, consumer_side, engines, ledger_extra, ledger_transfer_config, prompts
from tests.e2e.ledger_check import fold_logs

pytestmark = pytest.mark.vllm

OTHER_REQUESTS = 4
"""The producer's other traffic after it let the transfer go (constant-token prompts, KV unlike the batch's)."""

DEFER_TIMEOUT_S = 3.0
"""Short, so that the test waits seconds for the producer to let go; the drain allows far longer."""


def test_a_consumer_delayed_past_the_deadline_recomputes_and_answers_right(tiny_model: str, tmp_path: Path) -> None:
    pp, cp = allocate_ports()
    logs = tmp_path / "logs"
    producer_spec = {
        "model": tiny_model,
        "kv_transfer_config": ledger_transfer_config(
            "kv_producer", "prefill-0", ledger_extra("read", pp, cp, logs, defer_timeout=DEFER_TIMEOUT_S)
        ),
    }
    consumer_config = ledger_transfer_config("kv_consumer", "decode-0", ledger_extra("read", cp, pp, logs))
    consumer_config["kv_load_failure_policy"] = "recompute"
    consumer_spec = {"model": tiny_model, "kv_transfer_config": consumer_config}
    batch = prompts(2)
    others = [[token] * len(batch[0]) for token in (5, 900, 77, 401)[:OTHER_REQUESTS]]  # KV unlike the batch's
    with engines(("prefill", producer_spec), ("decode", consumer_spec)) as (p, c):
        plain = [o["tokens"] for o in p.generate([{"prompt": x, "max_tokens": 8} for x in batch])]
        prefilled = p.generate(
            [
                {
                    "prompt": x,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"tx-l{i}"},
                }
                for i, x in enumerate(batch)
            ]
        )
        # The decode engine is backlogged: the producer's deadline passes first and it frees the blocks ...
        drained = p.call({"op": "drain", "timeout_s": 120})
        assert drained["idle"] and drained["connector"]["live"] == 0, drained
        # ... which its other traffic reuses at once.
        p.generate([{"prompt": x, "max_tokens": 8} for x in others])
        late = c.generate(
            [
                {"prompt": x, "max_tokens": 8, "kv_transfer_params": consumer_side(o["kv_transfer_params"])}
                for x, o in zip(batch, prefilled, strict=True)
            ]
        )
        assert [o["tokens"] for o in late] == plain
    folded = fold_logs(logs)
    consumer_fails = [
        r for r in folded.releases if r.role == "consumer" and r.source.endswith("/tp0") and r.cause == "failed"
    ]
    assert len(consumer_fails) == len(batch)
    assert all(r.why == "read_refused" for r in consumer_fails), consumer_fails
    producer_expired = [r for r in folded.releases if r.role == "producer" and r.cause == "expired"]
    assert producer_expired  # it let go by its deadline, before the read came
    assert not [f for f in folded.findings if f.code == "premature_release"]
