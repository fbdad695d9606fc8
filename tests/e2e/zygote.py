"""A process that has imported vLLM once and forks each test engine from there (`python -m tests.e2e.zygote SOCKET`).

An engine process spends about 10 of its 12 CPU seconds starting Python and importing torch, vLLM and the
modules an `LLM` loads; a pytest worker starts dozens of engines. The zygote pays that once: it imports them,
then for each request on its unix socket forks a child that becomes `python -m tests.e2e.engine_main SPEC`
would: a session of its own, the request's environment and working directory, the stdin and stdout pipe ends
the request passed (SCM_RIGHTS), and `engine_main.main()`. Everything an engine does happens in the child,
after the fork: the `LLM`, its connector (kvledger is not imported here), its sockets and threads. vLLM's own
multiprocessing forks its workers from a process that imported it the same way.

The zygote itself is one thread (forking a process with other threads running can copy a lock held); it
refuses to start, exiting 3, when importing left a thread behind. It answers a request with the child's pid,
and once the child exits with its status (`{"exit": code}`, a negative code a signal, as `subprocess`
says it), then closes the connection. It exits, killing the engines still running, on SIGTERM (the test
process's exit) or when the process that started it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

PRELOADED = (
    "vllm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.distributed.kv_transfer.kv_connector.factory",
)
"""What every engine imports and this process imports for them (a module missing here is imported by the child)."""
REQUEST_BYTES_MAX = 1 << 20
PARENT_POLL_S = 1.0


def _preload() -> None:
    for name in PRELOADED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401  (engine_main's lazy imports)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict[str, Any], fds: list[int], own: list[socket.socket], wakeup: tuple[int, int]) -> None:
    """Become the engine process (never returns)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        for sock in own:
            sock.close()
        for fd in wakeup:
            os.close(fd)
        os.setsid()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.argv = ["tests.e2e.engine_main", *request["args"]]
        from tests.e2e import engine_main

        engine_main.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    parent = os.getppid()
    _preload()
    if threading.active_count() > 1:
        print(f"zygote: importing vLLM left {threading.active_count()} threads; not forking", file=sys.stderr)
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the path appears once the zygote accepts
    wakeup = os.pipe()  # a child's exit wakes the select at once (SIGCHLD writes a byte here)
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent and not stopping:
        ready, _, _ = select.select([listener.fileno(), wakeup[0]], [], [], PARENT_POLL_S)
        if wakeup[0] in ready:
            while True:
                try:
                    if not os.read(wakeup[0], 512):
                        break
                except BlockingIOError:
                    break
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, REQUEST_BYTES_MAX, 2)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(json.loads(data), fds, [listener, conn, *children.values()], wakeup)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            told = children.pop(pid, None)
            if told is not None:
                with contextlib.suppress(OSError):  # the test process went away
                    told.sendall(json.dumps({"exit": _exit_code(status)}).encode() + b"\n")
                told.close()
    for pid in children:  # the test process is gone: so are its engines
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


PER_TEST = ("PYTEST_CURRENT_TEST",)
"""Variables pytest changes at every test, which nothing the zygote imports reads."""


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in PER_TEST}


class _Lines:
    """The lines the zygote sends on one connection (its pid, then its exit status), read with a timeout: one
    buffer, so a line that came with another is never left where `select` cannot see it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.closed = False

    def next(self, timeout: float | None) -> str | None:
        """The next line; "" once the zygote closed the connection; None if none came within `timeout`."""
        while b"\n" not in self.buffer and not self.closed:
            ready, _, _ = select.select([self.conn], [], [], timeout)
            if not ready:
                return None
            chunk = self.conn.recv(4096)
            self.buffer += chunk
            self.closed = not chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()


class Forked:
    """What the harness uses of `subprocess.Popen` (pid, stdin, stdout, poll, wait), for an engine the zygote
    forked: its exit status comes on the request's connection."""

    def __init__(self, args: list[str], pid: int, lines: _Lines, stdin: Any, stdout: Any) -> None:
        self.args = args
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._lines = lines

    def _take(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._lines.next(timeout)
            if line is not None:
                self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL  # the zygote died
                self._lines.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._take(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._take(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


class Zygote:
    """The client end: starts `python -m tests.e2e.zygote` (once, at the first engine) and asks it for engines."""

    def __init__(self, env: dict[str, str], cwd: str, start_timeout_s: float) -> None:
        self.env = _read_at_import(env)
        """What the zygote imported vLLM with: an engine wanting another environment is not forked from it (a
        module may read a variable once, at import); see `forks_for`."""
        self.folder = tempfile.mkdtemp(prefix="kvledger-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "log"), "w")  # noqa: SIM115  (open for the zygote's life)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.zygote", self.path], cwd=cwd, env=env,
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        end = time.monotonic() + start_timeout_s
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                raise RuntimeError(f"the engine zygote did not start (see {self.log.name})")
            time.sleep(0.05)
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the zygote (it kills the engines it forked that still run) and remove its folder."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def forks_for(self, env: dict[str, str]) -> bool:
        """Whether an engine in `env` can be forked from this zygote: the environment it imported vLLM with."""
        return _read_at_import(env) == self.env

    def spawn(self, args: list[str], env: dict[str, str], cwd: str) -> Forked:
        """An engine process running `python -m tests.e2e.engine_main *args` in `env` and `cwd`."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [request], [stdin_r, stdout_w])
            lines = _Lines(conn)
            line = lines.next(None)
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        if not line:
            conn.close()
            os.close(stdin_w)
            os.close(stdout_r)
            raise RuntimeError("the engine zygote closed the connection")
        stdin = open(stdin_w, "w")  # noqa: SIM115  (the engine's stdin, closed with it)
        stdout = open(stdout_r)  # noqa: SIM115
        return Forked(args, int(json.loads(line)["pid"]), lines, stdin, stdout)


if __name__ == "__main__":
    serve(sys.argv[1])
