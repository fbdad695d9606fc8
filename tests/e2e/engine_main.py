"""One vLLM engine in its own process, driven by JSON lines on stdin; answers on stdout after a marker.

`python -m tests.e2e.engine_main '<json engine spec>'`. Commands: `generate`
(a batch of token prompts, each with its own kv_transfer_params), `drain` (step
until the scheduler holds nothing, e.g. a producer waiting for its release),
`stats` and `exit`. Between commands the engine keeps stepping while its
scheduler still has work, as vLLM's own busy loop would (LLM.generate alone stops
stepping once its outputs are done, and a producer's delayed frees would never run).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

ANSWER_MARKER = "@@kvledger-e2e "
"""Prefix of the lines that carry answers; everything else on stdout is vLLM's logging."""

IDLE_POLL_S = 0.2
BUSY_POLL_S = 0.005


def make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 256,
        "dtype": "float32",
        "seed": 0,
        "gpu_memory_utilization": 0.3,
        "enable_prefix_caching": False,
    }
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("metrics_port"):
        kwargs["disable_log_stats"] = False  # vLLM's Prometheus stat logger records every step's stats
    llm = LLM(**kwargs)
    if spec.get("metrics_port"):
        # The registry vLLM's OpenAI server serves at /metrics, served here by prometheus_client on loopback.
        from prometheus_client import start_http_server

        start_http_server(spec["metrics_port"], addr="127.0.0.1")
    return llm


def answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(ANSWER_MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def generate(llm: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [
        SamplingParams(
            max_tokens=r.get("max_tokens", 8),
            temperature=0.0,
            detokenize=False,
            extra_args={"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None,
        )
        for r in requests
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "kv_transfer_params": o.kv_transfer_params,
            "num_cached_tokens": o.num_cached_tokens or 0,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for o in outputs
    ]


def stats(llm: Any) -> dict[str, Any]:
    connector = _scheduler(llm).connector
    core = getattr(connector, "scheduler", None)
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None
    return {
        "connector": core.stats() if core is not None else None,
        "worker_counters": dict(worker.counters) if worker is not None else None,
        "has_requests": _scheduler(llm).has_requests(),
    }


def drain(llm: Any, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while _scheduler(llm).has_requests():
        if time.monotonic() > end:
            return False
        llm.llm_engine.step()
        time.sleep(BUSY_POLL_S)
    return True


def serve(llm: Any) -> None:
    answer({"ready": True, "pid": os.getpid()})
    while True:
        busy = _scheduler(llm).has_requests()
        ready, _, _ = select.select([sys.stdin], [], [], BUSY_POLL_S if busy else IDLE_POLL_S)
        if not ready:
            if busy:
                llm.llm_engine.step()
            continue
        line = sys.stdin.readline()
        if not line:
            return  # the test process went away
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            answer({"outputs": generate(llm, command["requests"])})
        elif op == "drain":
            answer({"idle": drain(llm, command.get("timeout_s", 30.0)), **stats(llm)})
        elif op == "stats":
            answer(stats(llm))
        elif op == "exit":
            answer({"bye": True})
            return


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm = make_llm(spec)
    try:
        serve(llm)
    finally:
        # Closes the connector's incident log and sockets before the process ends.
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
