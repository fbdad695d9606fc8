"""Parent side of the end-to-end tests: engine subprocesses (started, spoken to, always killed) and their configs."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.ids import stamped_id
from tests.connector.pd import EnginePorts
from tests.e2e.engine_main import ANSWER_MARKER
from tests.e2e.zygote import Forked, Zygote

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_START_TIMEOUT_S = 240.0
"""A cold engine starts in ~10 s here; the margin is for a loaded CI machine, not a performance claim."""
COMMAND_TIMEOUT_S = 180.0
PORT_CLASH = "Address already in use"
PORT_CLASH_RETRIES = 3
PORT_CLASH_WAIT_S = 1.0
LOG_TAIL_LINES = 80


class EngineError(RuntimeError):
    """An engine process died, or did not answer in time; carries the tail of its log."""


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # one process per engine: starts in ~10 s instead of ~30 s
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


_zygotes: list[Zygote | None] = []
_zygote_lock = threading.Lock()


def _zygote() -> Zygote | None:
    """This test process's engine zygote (`tests.e2e.zygote`), started at the first engine; None where
    `KVLEDGER_E2E_ZYGOTE=0` or it cannot start (each engine is then a fresh `python -m tests.e2e.engine_main`)."""
    with _zygote_lock:
        if not _zygotes:
            zygote = None
            if os.environ.get("KVLEDGER_E2E_ZYGOTE", "1") != "0":
                try:
                    zygote = Zygote(engine_env(), str(REPO_ROOT), ENGINE_START_TIMEOUT_S)
                except (OSError, RuntimeError) as error:
                    print(f"kvledger e2e: engines start without the zygote ({error})", file=sys.stderr)
            _zygotes.append(zygote)
        return _zygotes[0]


class EngineProcess:
    """`python -m tests.e2e.engine_main` with a JSON command line protocol."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self.spec = spec
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        zygote = _zygote()
        env = engine_env()
        self.proc: subprocess.Popen[str] | Forked
        if zygote is not None and zygote.forks_for(env):  # the process below, forked from one that imported vLLM
            self.proc = zygote.spawn([json.dumps(spec)], env, str(REPO_ROOT))
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.engine_main", json.dumps(spec)],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # so that a kill reaches every child it may start
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(ANSWER_MARKER):
                self._answers.put(json.loads(line[len(ANSWER_MARKER) :]))
            else:
                self.tail.append(line.rstrip())
        self._answers.put(None)

    def _error(self, what: str) -> EngineError:
        return EngineError(f"engine {self.name}: {what}\n--- last log lines ---\n" + "\n".join(self.tail))

    def wait_answer(self, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise self._error(f"no answer within {timeout_s} s") from None
        if answer is None:
            raise self._error(f"exited with {self.proc.wait()}")
        return answer

    def wait_ready(self) -> None:
        self.wait_answer(ENGINE_START_TIMEOUT_S)

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._error("stdin closed") from None

    def call(self, command: dict[str, Any], timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        self.send(command)
        return self.wait_answer(timeout_s)

    def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        outputs: list[dict[str, Any]] = self.call({"op": "generate", "requests": requests})["outputs"]
        return outputs

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        """Ask the engine to exit (it closes its connector and incident log); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout_s=30)
                self.proc.wait(timeout=30)
            except (EngineError, subprocess.TimeoutExpired, OSError):
                pass
        self.kill()


@contextmanager
def engine(name: str, spec: dict[str, Any]) -> Iterator[EngineProcess]:
    """An engine process that is killed however the block ends."""
    process = EngineProcess(name, spec)
    try:
        process = _ready(process)
        yield process
    finally:
        process.close()


def _ready(process: EngineProcess) -> EngineProcess:
    """`process` once it answers ready, or the same engine started again where a port it binds was taken in the
    moment it bound it (`free_loopback_ports`: another test choosing ports, or a port a closed engine held,
    taken before this one bound it): its callers retry on a clash. The process that failed is closed."""
    retries = 0
    while True:
        try:
            process.wait_ready()
            return process
        except EngineError as error:
            process.close()
            retries += 1
            if PORT_CLASH not in str(error) or retries > PORT_CLASH_RETRIES:
                raise
        time.sleep(PORT_CLASH_WAIT_S)
        process = EngineProcess(process.name, process.spec)


def allocate_ports() -> tuple[EnginePorts, EnginePorts]:
    p = free_loopback_ports(6)
    return EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])


def ledger_extra(mode: str, mine: EnginePorts, peer: EnginePorts, log_dir: Path, **more: Any) -> dict[str, Any]:
    """kv_connector_extra_config for one engine of a 1P1D pair on loopback with the tcp transport."""
    return {
        "read_mode": mode == "read",
        "backend": "tcp",
        "host_ip": "127.0.0.1",
        "handshake_port": mine.handshake,
        "notify_port": mine.notify,
        "transport_port": mine.transport,
        "peers": [
            {
                "host": "127.0.0.1",
                "handshake_port": peer.handshake,
                "notify_port": peer.notify,
                "transport_port": peer.transport,
            }
        ],
        "incident_log_dir": str(log_dir),
        **more,
    }


def ledger_transfer_config(role: str, engine_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "LedgerConnector",
        "kv_connector_module_path": "kvledger.connector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


@contextmanager
def engines(*named_specs: tuple[str, dict[str, Any]]) -> Iterator[list[EngineProcess]]:
    """Several engines started side by side (each loads while the others do), all killed at the end."""
    started: list[EngineProcess] = []
    try:
        for name, spec in named_specs:
            started.append(EngineProcess(name, spec))
        for i, process in enumerate(started):
            started[i] = _ready(process)
        yield started
    finally:
        for process in started:
            process.close()


def prompts(count: int, base_len: int = 150) -> list[list[int]]:
    """Distinct token prompts longer than one CPU block (128), so that whole blocks move."""
    return [[(i * 7 + k * 13) % 997 + 3 for i in range(base_len + 10 * k)] for k in range(count)]


def transfer_id() -> str:
    """A stamped id, as kvledger's proxy issues (proxy/app.py `new_transfer_id`)."""
    return stamped_id(time.time(), os.urandom(10))


def peer_params(ports: EnginePorts) -> dict[str, Any]:
    return {"remote_host": "127.0.0.1", "remote_handshake_port": ports.handshake, "remote_notify_port": ports.notify}


def consumer_side(params: dict[str, Any]) -> dict[str, Any]:
    # vLLM 0.32 reports the producer's own prefix hits (this key) as the consumer's num_cached_tokens;
    # without it the consumer reports the tokens it loaded, which is what these tests check.
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def run_1p1d(
    producer: EngineProcess,
    consumer: EngineProcess,
    mode: str,
    batch: list[list[int]],
    producer_ports: EnginePorts,
    consumer_ports: EnginePorts,
    max_tokens: int = 8,
) -> list[dict[str, Any]]:
    """One batch through prefill then decode: READ serially (params from the producer), WRITE concurrently."""
    ids = [transfer_id() for _ in batch]
    if mode == "read":
        prefilled = producer.generate(
            [
                {"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": t}}
                for p, t in zip(batch, ids, strict=True)
            ]
        )
        return consumer.generate(
            [
                {"prompt": p, "max_tokens": max_tokens, "kv_transfer_params": consumer_side(o["kv_transfer_params"])}
                for p, o in zip(batch, prefilled, strict=True)
            ]
        )
    consumer.send(
        {
            "op": "generate",
            "requests": [
                {
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": t, **peer_params(producer_ports)},
                }
                for p, t in zip(batch, ids, strict=True)
            ],
        }
    )
    producer.generate(
        [
            {
                "prompt": p,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": t, **peer_params(consumer_ports)},
            }
            for p, t in zip(batch, ids, strict=True)
        ]
    )
    outputs: list[dict[str, Any]] = consumer.wait_answer()["outputs"]
    return outputs
