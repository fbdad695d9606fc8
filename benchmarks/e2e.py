"""1P1D through real vLLM (CPU, tiny model): LedgerConnector (tcp, READ) vs vLLM's ExampleConnector, same run.

Time to first token (prefill, then a decode of one token) and total time (prefill,
then a decode of `--max-tokens`) of a batch of requests, each the median of
`--rounds` rounds with fresh prompts. The baseline moves KV through files on disk
(ExampleConnector); ours through the tcp transport plus the ledger's bookkeeping.
Ends with one JSON line of the figures. Run from the repository root:
`python -m benchmarks.e2e`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

from benchmarks.quick import parse_args
from tests.e2e.harness import (
    EngineProcess,
    allocate_ports,
    consumer_side,
    engines,
    ledger_extra,
    ledger_transfer_config,
    transfer_id,
)
from tests.e2e.tiny_model import write_tiny_model

FIELDS: tuple[str, ...] = (
    "requests",
    "rounds",
    "max_tokens",
    "ledger_ttft_s",
    "example_ttft_s",
    "ttft_ratio",
    "ledger_total_s",
    "example_total_s",
    "total_ratio",
)


def _prompts(round_index: int, count: int) -> list[list[int]]:
    # Fresh prompts every round, so no connector finds a previous round's KV.
    return [[(i * 7 + k * 13 + round_index * 101) % 997 + 3 for i in range(150 + 5 * k)] for k in range(count)]


def _ledger_batch(p: EngineProcess, c: EngineProcess, batch: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    pre = p.generate(
        [
            {
                "prompt": x,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id()},
            }
            for x in batch
        ]
    )
    c.generate(
        [
            {"prompt": x, "max_tokens": max_tokens, "kv_transfer_params": consumer_side(o["kv_transfer_params"])}
            for x, o in zip(batch, pre, strict=True)
        ]
    )
    return time.perf_counter() - start


def _example_batch(p: EngineProcess, c: EngineProcess, batch: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    p.generate([{"prompt": x, "max_tokens": 1} for x in batch])
    c.generate([{"prompt": x, "max_tokens": max_tokens} for x in batch])
    return time.perf_counter() - start


def _measure(p: EngineProcess, c: EngineProcess, run: Any, args: argparse.Namespace) -> tuple[float, float]:
    ttft, total = [], []
    for r in range(args.rounds):
        ttft.append(run(p, c, _prompts(2 * r, args.requests), 1))
        total.append(run(p, c, _prompts(2 * r + 1, args.requests), args.max_tokens))
        p.call({"op": "drain", "timeout_s": 60})
    return statistics.median(ttft), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parse_args(parser, requests=1, rounds=1, max_tokens=2)
    tmp = Path(tempfile.mkdtemp(prefix="kvledger-e2e-bench-"))
    model = str(write_tiny_model(tmp / "model"))
    pp, cp = allocate_ports()

    def spec(config: dict[str, Any]) -> dict[str, Any]:
        return {"model": model, "kv_transfer_config": config}

    ledger = (
        (
            "prefill",
            spec(ledger_transfer_config("kv_producer", "prefill-0", ledger_extra("read", pp, cp, tmp / "logs"))),
        ),
        ("decode", spec(ledger_transfer_config("kv_consumer", "decode-0", ledger_extra("read", cp, pp, tmp / "logs")))),
    )
    with engines(*ledger) as (p, c):
        ledger_ttft, ledger_total = _measure(p, c, _ledger_batch, args)
    example_extra = {"shared_storage_path": str(tmp / "example-kv")}
    example = (
        (
            "prefill",
            spec(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": example_extra,
                }
            ),
        ),
        (
            "decode",
            spec(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_consumer",
                    "kv_connector_extra_config": example_extra,
                }
            ),
        ),
    )
    with engines(*example) as (p, c):
        example_ttft, example_total = _measure(p, c, _example_batch, args)
    figures = {
        "benchmark": "e2e_1p1d",
        "requests": args.requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "ledger_ttft_s": round(ledger_ttft, 4),
        "example_ttft_s": round(example_ttft, 4),
        "ttft_ratio": round(ledger_ttft / example_ttft, 3),
        "ledger_total_s": round(ledger_total, 4),
        "example_total_s": round(example_total, 4),
        "total_ratio": round(ledger_total / example_total, 3),
    }
    print(f"TTFT   ledger {ledger_ttft:.3f} s  example {example_ttft:.3f} s  ratio {figures['ttft_ratio']}")
    print(f"total  ledger {ledger_total:.3f} s  example {example_total:.3f} s  ratio {figures['total_ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
