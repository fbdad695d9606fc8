"""READ and WRITE through real vLLM engines: producer and consumer processes, LedgerConnector, tcp on loopback.

The consumer's greedy tokens must equal a plain (non-disaggregated) run of the
same engine build, and a consumer whose received blocks are overwritten with
noise (the connector's test hook) must decode something else: without that
control, equality could come from a decode that ignored the transferred KV.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import (
    EngineProcess,
    allocate_ports,
    engine,
    engines,
    ledger_extra,
    ledger_transfer_config,
    prompts,
    run_1p1d,
)
from tests.e2e.hooks import CORRUPT_RECEIVED_KV
from tests.e2e.ledger_check import assert_clean, fold_logs
from tests.e2e.tiny_model import BLOCK_SIZE_CPU

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


def _drained(process: EngineProcess) -> dict[str, object]:
    answer = process.call({"op": "drain", "timeout_s": 60})
    assert answer["idle"], f"{process.name} still holds requests: {answer}"
    return answer


@pytest.mark.parametrize("mode", ["read", "write"])
def test_consumer_decodes_transferred_kv_token_equal(mode: str, tiny_model: str, tmp_path: Path) -> None:
    pp, cp = allocate_ports()
    logs, control_logs = tmp_path / "logs", tmp_path / "control-logs"
    # And one prompt ending one token into a block: its KV fills one block more than the prompt less its
    # last token does, so a consumer that loaded one token less would pair every block with the wrong one.
    batch = [*prompts(3), [(i * 11 + 5) % 997 + 3 for i in range(BLOCK_SIZE_CPU + 1)]]

    def spec(role: str, name: str, mine: object, peer: object, folder: Path, **hooks: object) -> dict[str, object]:
        extra = ledger_extra(mode, mine, peer, folder, **hooks)  # type: ignore[arg-type]
        return {"model": tiny_model, "kv_transfer_config": ledger_transfer_config(role, name, extra)}

    producer_spec = spec("kv_producer", "prefill-0", pp, cp, logs)
    with engines(("prefill", producer_spec), ("decode", spec("kv_consumer", "decode-0", cp, pp, logs))) as (p, c):
        plain = [o["tokens"] for o in p.generate([{"prompt": x, "max_tokens": MAX_TOKENS} for x in batch])]
        assert len({tuple(t) for t in plain}) > 1, "prompts must decode differently for equality to mean anything"
        out = run_1p1d(p, c, mode, batch, pp, cp, MAX_TOKENS)
        assert [o["tokens"] for o in out] == plain
        for o, x in zip(out, batch, strict=True):
            # The consumer loaded the whole prompt from the producer (vLLM recomputes its last token itself).
            assert o["num_cached_tokens"] == len(x) > BLOCK_SIZE_CPU
        _drained(p)
        _drained(c)
        c.close()
        corrupt_spec = spec("kv_consumer", "decode-1", cp, pp, control_logs, test_hook_received_kv=CORRUPT_RECEIVED_KV)
        with engine("decode-corrupt", corrupt_spec) as bad:
            corrupted = [o["tokens"] for o in run_1p1d(p, bad, mode, batch, pp, cp, MAX_TOKENS)]
            _drained(p)
            _drained(bad)
        assert all(a != b for a, b in zip(corrupted, plain, strict=True)), "noise in the moved KV changed nothing"

    folded = fold_logs(logs)
    assert_clean(folded)
    assert folded.causes("prefill-0") == {"completed": 2 * len(batch) * 2}  # two runs, scheduler and worker sides
    assert folded.causes("decode-0") == {"completed": 2 * len(batch)}
    assert_clean(fold_logs(control_logs))
