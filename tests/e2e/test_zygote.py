"""An engine forked by the zygote is a process as `subprocess` would start: its own pid and session, the test's
stdout, its exit status told as `subprocess` tells it (0 on exit, -9 when killed). An engine that exits because
a port it binds was taken in that moment is started again (the harness's `_ready`)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.harness import (
    REPO_ROOT,
    EngineProcess,
    _zygote,
    allocate_ports,
    engine,
    engine_env,
    ledger_extra,
    ledger_transfer_config,
)
from tests.e2e.zygote import Forked

pytestmark = pytest.mark.vllm


def test_a_forked_engine_answers_exits_with_0_and_a_killed_one_with_minus_9(tiny_model: str) -> None:
    zygote = _zygote()
    if zygote is None:
        pytest.skip("KVLEDGER_E2E_ZYGOTE=0: engines start as fresh processes")
    first, second = EngineProcess("first", {"model": tiny_model}), EngineProcess("second", {"model": tiny_model})
    for process in (first, second):
        assert isinstance(process.proc, Forked)
        ready = process.wait_answer()
        assert ready["pid"] == process.proc.pid != os.getpid()
        assert os.getpgid(process.proc.pid) == process.proc.pid  # a session of its own: killpg reaches its children
        assert process.proc.poll() is None
    assert first.proc.pid != second.proc.pid
    assert first.call({"op": "stats"})["has_requests"] is False
    assert first.call({"op": "exit"}) == {"bye": True}
    assert first.proc.wait(timeout=60) == 0
    second.kill()
    assert second.proc.returncode == -signal.SIGKILL


def test_a_child_that_fails_exits_with_1_its_traceback_on_its_stdout() -> None:
    zygote = _zygote()
    if zygote is None:
        pytest.skip("KVLEDGER_E2E_ZYGOTE=0: engines start as fresh processes")
    child = zygote.spawn(["not json"], engine_env(), str(REPO_ROOT))  # engine_main parses its spec first
    output = child.stdout.read()
    assert child.wait(timeout=60) == 1
    assert "json.decoder.JSONDecodeError" in output, output[-2000:]


def test_an_engine_whose_port_is_taken_as_it_binds_is_started_again(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The consumer's notify port is held by another socket when the engine binds it: the engine exits on the
    # clash, the port is let go between the tries (as a test's probing bind or a closed engine's would be),
    # and the engine started again answers.
    mine, peer = allocate_ports()
    taken = socket.socket()
    taken.bind(("127.0.0.1", mine.notify))
    taken.listen()
    waits: list[float] = []

    def between_tries(seconds: float) -> None:
        waits.append(seconds)
        taken.close()

    monkeypatch.setattr(harness.time, "sleep", between_tries)
    extra = ledger_extra("read", mine, peer, tmp_path / "logs")
    spec = {"model": tiny_model, "kv_transfer_config": ledger_transfer_config("kv_consumer", "decode-0", extra)}
    try:
        with engine("decode-0", spec) as consumer:
            assert consumer.call({"op": "stats"})["has_requests"] is False
    finally:
        taken.close()
    assert waits == [harness.PORT_CLASH_WAIT_S]
