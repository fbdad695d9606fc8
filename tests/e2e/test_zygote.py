"""An engine forked by the zygote is a process as `subprocess` would start: its own pid and session, the test's
stdout, its exit status told as `subprocess` tells it (0 on exit, -9 when killed)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.harness import REPO_ROOT, EngineProcess, _zygote, engine_env
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
