"""A hybrid model through real vLLM engines: a tiny Gemma3 (a 32-token sliding-window layer beside a
full-attention layer; two KV cache groups under vLLM's hybrid KV cache manager), READ over tcp on loopback.

The consumer's greedy tokens must equal a plain run, and a consumer whose received blocks are overwritten with
noise must decode something else. The same for a tiny hybrid Mamba model (Granite 4's architecture: a Mamba2 layer
beside an attention layer), whose Mamba state moves with the attention blocks, in READ and in WRITE mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.ledger.events import block_groups_of
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
from tests.e2e.tiny_model import BLOCK_SIZE_CPU, TINY_GEMMA3, TINY_GRANITE_HYBRID, write_tiny_model

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


def _drained(process: EngineProcess) -> None:
    answer = process.call({"op": "drain", "timeout_s": 60})
    assert answer["idle"], f"{process.name} still holds requests: {answer}"


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_hybrid_model_decodes_transferred_kv_token_equal(mode: str, tmp_path: Path) -> None:
    model = str(write_tiny_model(tmp_path / "tiny-gemma3", TINY_GEMMA3))
    pp, cp = allocate_ports()
    logs, control_logs = tmp_path / "logs", tmp_path / "control-logs"
    # Past 256 tokens' worth of window: the window layer keeps only the second block, the other layer both.
    batch = prompts(3, base_len=200)

    def spec(role: str, name: str, mine: object, peer: object, folder: Path, **hooks: object) -> dict[str, object]:
        extra = ledger_extra(mode, mine, peer, folder, **hooks)  # type: ignore[arg-type]
        return {"model": model, "kv_transfer_config": ledger_transfer_config(role, name, extra)}

    with engines(
        ("prefill", spec("kv_producer", "prefill-0", pp, cp, logs)),
        ("decode", spec("kv_consumer", "decode-0", cp, pp, logs)),
    ) as (p, c):
        plain = [o["tokens"] for o in p.generate([{"prompt": x, "max_tokens": MAX_TOKENS} for x in batch])]
        assert len({tuple(t) for t in plain}) > 1, "prompts must decode differently for equality to mean anything"
        out = run_1p1d(p, c, mode, batch, pp, cp, MAX_TOKENS)
        assert [o["tokens"] for o in out] == plain
        for o, x in zip(out, batch, strict=True):
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
    assert folded.causes("decode-0") == {"completed": 2 * len(batch)}  # scheduler and worker sides
    consumer_maps = [t.map_event for (source, _), t in folded.state.transfers.items() if source.startswith("decode-0")]
    assert len(consumer_maps) == 2 * len(batch)
    # WRITE: the producer's workers map (and write from) the blocks at the prompt's allocation, cut to what
    # the window keeps after the forward, as vLLM keeps them and the consumer allocates them.
    producer_maps = [t.map_event for (source, _), t in folded.state.transfers.items() if source == "prefill-0/tp0"]
    assert len(producer_maps) == 2 * len(batch)  # the plain consumer's transfers and the corrupted one's
    for m in consumer_maps + producer_maps:
        assert m is not None and m.block_groups is not None
        window, full = block_groups_of(m.block_ids, m.block_groups)
        # Two 128-token blocks hold a 200+ token prompt; the 32-token window needs only the second.
        assert (len(window), len(full)) == (1, 2)
        if m.role == "consumer" and mode == "read":
            assert m.remote_block_groups == m.block_groups


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_hybrid_mamba_model_decodes_transferred_state_token_equal(mode: str, tmp_path: Path) -> None:
    """READ: the consumer reads the state with the attention blocks. WRITE: the producer writes them, the
    attention layers from the forward and the Mamba state after it (vLLM never saves a Mamba layer)."""
    model = str(write_tiny_model(tmp_path / "tiny-granite-hybrid", TINY_GRANITE_HYBRID))
    pp, cp = allocate_ports()
    logs, control_logs = tmp_path / "logs", tmp_path / "control-logs"
    batch = prompts(3, base_len=200)

    def spec(role: str, name: str, mine: object, peer: object, folder: Path, **hooks: object) -> dict[str, object]:
        extra = ledger_extra(mode, mine, peer, folder, **hooks)  # type: ignore[arg-type]
        return {"model": model, "kv_transfer_config": ledger_transfer_config(role, name, extra)}

    with engines(
        ("prefill", spec("kv_producer", "prefill-0", pp, cp, logs)),
        ("decode", spec("kv_consumer", "decode-0", cp, pp, logs)),
    ) as (p, c):
        # The plain run is the consumer's own (the producer cuts a P/D prompt one token short, a plain one not).
        plain = [o["tokens"] for o in c.generate([{"prompt": x, "max_tokens": MAX_TOKENS} for x in batch])]
        assert len({tuple(t) for t in plain}) > 1, "prompts must decode differently for equality to mean anything"
        out = run_1p1d(p, c, mode, batch, pp, cp, MAX_TOKENS)
        assert [o["tokens"] for o in out] == plain
        for o, x in zip(out, batch, strict=True):
            assert o["num_cached_tokens"] == len(x) - 1  # h(N-1) loaded; the last prompt token computed here
        _drained(p)
        _drained(c)
        c.close()
        corrupt_spec = spec("kv_consumer", "decode-1", cp, pp, control_logs, test_hook_received_kv=CORRUPT_RECEIVED_KV)
        with engine("decode-corrupt", corrupt_spec) as bad:
            corrupted = [o["tokens"] for o in run_1p1d(p, bad, mode, batch, pp, cp, MAX_TOKENS)]
            _drained(p)
            _drained(bad)
        assert all(a != b for a, b in zip(corrupted, plain, strict=True)), "noise in the moved state changed nothing"

    folded = fold_logs(logs)
    assert_clean(folded)
    assert folded.causes("decode-0") == {"completed": 2 * len(batch)}
    consumer_maps = [t.map_event for (source, _), t in folded.state.transfers.items() if source.startswith("decode-0")]
    producer_maps = [t.map_event for (source, _), t in folded.state.transfers.items() if source.startswith("prefill-0")]
    for m in consumer_maps + producer_maps:
        assert m is not None and m.block_groups is not None and len(m.block_groups) == 2
        assert 1 in m.block_groups  # the Mamba group's one running state, beside the attention blocks
