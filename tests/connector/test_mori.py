"""The mori transport on the fake mori.io: the shared contract, send-queue-full vs terminal, polling, import guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from enum import IntEnum
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvledger.connector.transports.base import Code, TransferHandle
from kvledger.connector.transports.mori import (
    BACKEND,
    MoriTransport,
    MoriUnavailableError,
    failure_status,
)
from tests.connector.fake_mori import fake_io, installed_as_mori, make_mori_transport
from tests.connector.test_transport_contract import WAIT_S

# The shared contract suite (test_transport_contract.py) runs mori on the fake through its TRANSPORTS;
# this file holds what is mori's own.

ROOT = Path(__file__).resolve().parents[2]
NO_ROCM = "libamdhip64.so: cannot open shared object file: No such file or directory"


@pytest.fixture
def io() -> Iterator[ModuleType]:
    module = fake_io()
    module.faults.reset()
    try:
        yield module
    finally:
        module.faults.reset()


@pytest.fixture
def pair(io: ModuleType) -> Iterator[tuple[MoriTransport, MoriTransport]]:
    a, b = make_mori_transport(), make_mori_transport()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _linked(pair: tuple[MoriTransport, MoriTransport]) -> tuple[MoriTransport, Any, torch.Tensor, torch.Tensor]:
    """b reads from / writes to a's "kv" region: (b, session, a's tensor, b's tensor)."""
    a, b = pair
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.zeros(64)
    remote = a.register("kv", src)
    b.register("kv", dst)
    return b, b.connect(a.endpoint(), [remote]), src, dst


def _finished(b: MoriTransport, handle: TransferHandle) -> TransferHandle:
    assert b.wait_all([handle], WAIT_S)
    return handle


# -- completion paths ----------------------------------------------------------


def test_in_progress_status_is_polled_until_it_completes(
    io: ModuleType, pair: tuple[MoriTransport, MoriTransport]
) -> None:
    io.faults.in_progress_polls = 3
    b, session, src, dst = _linked(pair)
    handle = b.read(session, "kv", "kv", [(0, 0, 64)])
    assert handle.status().in_progress()  # the worker's poll sees it running
    assert _finished(b, handle).status().succeeded()
    assert torch.equal(dst[:16], src[:16]) and dst[16:].abs().sum() == 0


def test_completion_on_another_thread_is_seen_by_wait(
    io: ModuleType, pair: tuple[MoriTransport, MoriTransport]
) -> None:
    io.faults.hold_completions()
    b, session, src, dst = _linked(pair)
    handle = b.write(session, "kv", "kv", [(0, 128, 32)])
    assert handle.status().in_progress()  # held: nothing can have landed
    io.faults.release_completions()
    assert _finished(b, handle).status().succeeded()
    assert torch.equal(src[32:40], dst[:8])


def test_close_fails_batches_still_in_flight(io: ModuleType) -> None:
    a, b = make_mori_transport(), MoriTransport("127.0.0.1", 0, close_grace_s=0.0, mori_io=io)
    try:
        io.faults.hold_completions()
        b_, session, _, _ = _linked((a, b))
        handle = b_.read(session, "kv", "kv", [(0, 0, 4)])
        b.close()
        assert handle.status().failed() and handle.status().code is Code.CLOSED
    finally:
        io.faults.release_completions()
        a.close()
        b.close()


# -- send-queue-full is transient, the rest terminal ----------------------------


def test_sq_full_by_message_is_transient_then_the_retry_succeeds(
    io: ModuleType, pair: tuple[MoriTransport, MoriTransport]
) -> None:
    io.faults.fail_next(1)  # mori's own wording: ERR_RDMA_OP, "SQ full (batch): ..."
    io.faults.fail_next(1, message="post failed: sq FULL")  # case does not matter
    b, session, src, dst = _linked(pair)
    for _ in range(2):
        status = _finished(b, b.read(session, "kv", "kv", [(0, 0, 8)])).status()
        assert status.failed() and status.transient and status.code is Code.SEND_QUEUE_FULL, status
    assert _finished(b, b.read(session, "kv", "kv", [(0, 0, 8)])).status().succeeded()
    assert torch.equal(dst[:2], src[:2])


@pytest.mark.parametrize(
    ("code_name", "message", "expected"),
    [
        ("ERR_RDMA_OP", "ibv_post_send failed with 12: Cannot allocate memory", Code.REMOTE_ERROR),
        ("ERR_RDMA_OP", "SQ request exceeds capacity (batch): ep=0 requested=9000 max=256", Code.REMOTE_ERROR),
        ("ERR_BAD_STATE", "EP is degraded, rejecting new submissions", Code.REMOTE_ERROR),
        ("ERR_INVALID_ARGS", "length out of range", Code.BAD_REQUEST),
    ],
)
@pytest.mark.parametrize("on_completion", [False, True])
def test_other_failures_are_terminal(
    io: ModuleType,
    pair: tuple[MoriTransport, MoriTransport],
    code_name: str,
    message: str,
    expected: Code,
    on_completion: bool,
) -> None:
    io.faults.fail_next(1, getattr(io.StatusCode, code_name), message, on_completion=on_completion)
    b, session, _, dst = _linked(pair)
    status = _finished(b, b.read(session, "kv", "kv", [(0, 0, 8)])).status()
    assert status.failed() and not status.transient and status.code is expected, status
    assert code_name in status.message and message in status.message
    assert dst.abs().sum() == 0  # a failed read moved nothing


def test_sq_full_by_a_dedicated_code_when_mori_has_one(io: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    class StatusCodeWithSqFull(IntEnum):  # what a mori release with its own code would export
        SUCCESS = 0
        INIT = 1
        IN_PROGRESS = 2
        ERR_INVALID_ARGS = 11
        ERR_NOT_FOUND = 12
        ERR_RDMA_OP = 13
        ERR_BAD_STATE = 14
        ERR_GPU_OP = 15
        ERR_SQ_FULL = 16

    monkeypatch.setattr(io, "StatusCode", StatusCodeWithSqFull)
    a, b = make_mori_transport(), make_mori_transport()
    try:
        io.faults.fail_next(1, StatusCodeWithSqFull.ERR_SQ_FULL, "send queue exhausted")
        io.faults.fail_next(1, StatusCodeWithSqFull.ERR_RDMA_OP, "SQ full (batch)")  # the code decides now
        b_, session, _, _ = _linked((a, b))
        first = _finished(b, b_.read(session, "kv", "kv", [(0, 0, 8)])).status()
        second = _finished(b, b_.read(session, "kv", "kv", [(0, 0, 8)])).status()
        assert first.transient and first.code is Code.SEND_QUEUE_FULL, first
        assert second.failed() and not second.transient and second.code is Code.REMOTE_ERROR, second
    finally:
        a.close()
        b.close()


def test_failure_status_classifies_by_code_else_by_message() -> None:
    rdma_op = fake_io().StatusCode.ERR_RDMA_OP
    assert failure_status(rdma_op, "SQ full (single): ep=1", frozenset()).transient
    assert failure_status(rdma_op, "Sq Full", frozenset()).transient
    assert not failure_status(rdma_op, "wc status 12: transport retry counter exceeded", frozenset()).transient
    assert failure_status(16, "anything", frozenset({16})).transient
    assert not failure_status(13, "SQ full", frozenset({16})).transient


def test_a_non_contiguous_view_is_registered_by_its_extent(pair: tuple[MoriTransport, MoriTransport]) -> None:
    a, b = pair
    storage = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    view = storage[:, :4]  # strided: mori's register_torch_tensor would refuse it
    remote = a.register("kv", view)
    dst = torch.zeros(28)
    b.register("kv", dst)
    assert remote.size == dst.numel() * 4
    handle = _finished(b, b.read(b.connect(a.endpoint(), [remote]), "kv", "kv", [(0, 0, remote.size)]))
    assert handle.status().succeeded() and torch.equal(dst, storage.flatten()[:28])


# -- wiring ---------------------------------------------------------------------


def test_import_mori_io_path_works_with_the_fake_installed_and_leaves_nothing_behind() -> None:
    with installed_as_mori() as installed:
        assert installed.__file__ is not None and "fake_mori" in installed.__file__
        a, b = MoriTransport(), MoriTransport()  # no injection: `import mori.io` finds the fake
        try:
            b_, session, src, dst = _linked((a, b))
            assert _finished(b_, b_.read(session, "kv", "kv", [(4, 4, 8)])).status().succeeded()
            assert torch.equal(dst[1:3], src[1:3])
        finally:
            a.close()
            b.close()
    assert "mori" not in sys.modules and "mori.io" not in sys.modules


def test_xgmi_fabric_and_foreign_endpoints(pair: tuple[MoriTransport, MoriTransport], io: ModuleType) -> None:
    a, _ = pair
    xgmi = MoriTransport(fabric="xgmi", mori_io=io)
    try:
        b_, session, src, dst = _linked((a, xgmi))
        assert _finished(b_, b_.read(session, "kv", "kv", [(0, 0, 4)])).status().succeeded()
        assert dst[0] == src[0]
        with pytest.raises(ValueError, match="tcp"):
            xgmi.connect(a.endpoint().__class__(backend="tcp", host="127.0.0.1", port=1), [])
    finally:
        xgmi.close()
    with pytest.raises(ValueError, match="fabric"):
        MoriTransport(fabric="infiniband", mori_io=io)


# -- the import guard -------------------------------------------------------------


class _NoRocm(MetaPathFinder, Loader):
    """`import mori.io` as on a machine with mori's wheel but no ROCm: loading its C++ module raises OSError."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        return ModuleSpec(fullname, self, is_package=True) if fullname.split(".")[0] == "mori" else None

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        raise OSError(NO_ROCM)


def _without_mori(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        monkeypatch.delitem(sys.modules, name)


def test_selecting_mori_without_rocm_names_the_backend_and_the_oserror(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_mori(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", [_NoRocm(), *sys.meta_path])
    with pytest.raises(MoriUnavailableError) as caught:
        MoriTransport("127.0.0.1", 0)
    message = str(caught.value)
    assert f"backend {BACKEND!r}" in message and "OSError" in message and NO_ROCM in message
    assert isinstance(caught.value.__cause__, OSError)


def test_selecting_mori_when_not_installed_names_the_backend_and_the_importerror(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_mori(monkeypatch)
    monkeypatch.setitem(sys.modules, "mori", None)  # the import system's "not importable"
    with pytest.raises(MoriUnavailableError) as caught:
        MoriTransport("127.0.0.1", 0)
    message = str(caught.value)
    assert f"backend {BACKEND!r}" in message and "ModuleNotFoundError" in message and "mori" in message
    assert isinstance(caught.value.__cause__, ImportError)


@pytest.mark.parametrize("failure", ["OSError", "ImportError"])
def test_importing_the_connector_never_imports_mori(failure: str) -> None:
    """A fresh interpreter where mori cannot load: importing the connector and this transport still works."""
    script = textwrap.dedent(
        f"""
        import sys
        from importlib.abc import Loader, MetaPathFinder
        from importlib.machinery import ModuleSpec

        class NoMori(MetaPathFinder, Loader):
            def find_spec(self, fullname, path, target=None):
                return ModuleSpec(fullname, self) if fullname.split(".")[0] == "mori" else None
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                raise {failure}("simulated: mori cannot load")

        sys.meta_path.insert(0, NoMori())
        import kvledger.connector
        import kvledger.connector.transports
        import kvledger.connector.transports.mori as mori_transport
        assert "mori" not in sys.modules, "importing the connector imported mori"
        try:
            mori_transport.MoriTransport("127.0.0.1", 0)
        except mori_transport.MoriUnavailableError as error:
            assert "'mori'" in str(error) and "{failure}" in str(error), error
        else:
            raise AssertionError("selecting mori without mori did not fail")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def test_make_transport_selects_mori_and_names_the_backend_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.connector.transports import make_transport

    monkeypatch.setitem(sys.modules, "mori", None)
    with pytest.raises(MoriUnavailableError, match="'mori'"):
        make_transport("mori", "127.0.0.1", 0)
