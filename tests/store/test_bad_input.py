"""Clear errors for stores that cannot be opened: each a StoreError naming the URL or path."""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

import pytest

from kvledger.ledger.store.base import NotALedger, StoreError, StoreUnavailable
from kvledger.ledger.store.connect import open_store


def test_unparseable_and_unsupported_urls() -> None:
    with pytest.raises(StoreUnavailable, match="not a store URL"):
        open_store("postgresql://user@host:notaport/db")
    with pytest.raises(StoreUnavailable, match="unsupported store 'mysql'"):
        open_store("mysql://x/y")
    with pytest.raises(StoreUnavailable, match="driver 'asyncpg' is not supported"):
        open_store("postgresql+asyncpg://x/y")


def test_unreachable_server_names_the_url() -> None:
    with socket_closed_port() as port:
        url = f"postgresql://nobody:secret@127.0.0.1:{port}/nope"
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}") as caught:
            open_store(url)
    assert "secret" not in str(caught.value)  # the password is hidden


def test_missing_file_without_create(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    with pytest.raises(StoreUnavailable, match=r"no such file.*kvledger db upgrade"):
        open_store(str(path))
    assert not path.exists()  # SQLite did not create an empty file behind our back


def test_text_file_is_not_a_ledger(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("this is not a database\n" * 100)
    with pytest.raises(NotALedger, match=str(path)):
        open_store(str(path), create=True)


def test_foreign_sqlite_database_is_not_a_ledger(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY)")
    with pytest.raises(NotALedger, match=r"other tables: customers"):
        open_store(f"sqlite:///{path}", create=True)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="is a directory"):
        open_store(str(tmp_path), create=True)


def _open_in_read_only_dir() -> str:
    directory = Path(tempfile.mkdtemp(prefix="kvledger-ro-"))
    directory.chmod(0o555)
    try:
        open_store(str(directory / "ledger.db"), create=True)
    except StoreError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        directory.chmod(0o755)
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
    return "opened"


def test_read_only_directory() -> None:
    if os.geteuid() != 0:
        outcome = _open_in_read_only_dir()
    else:
        # root ignores permissions: check in a child that has given up root.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read_end)
            try:
                os.setgid(65534)
                os.setuid(65534)
                message = _open_in_read_only_dir()
            except BaseException as error:
                message = f"child error: {error!r}"
            os.write(write_end, message.encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            outcome = pipe.read().decode()
        os.waitpid(pid, 0)
    assert outcome.startswith("StoreUnavailable: "), outcome
    assert "kvledger-ro-" in outcome and "unable to open" in outcome


class socket_closed_port:
    """A loopback port with nothing listening on it."""

    def __enter__(self) -> int:
        import socket

        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port: int = probe.getsockname()[1]
        probe.close()
        return self.port

    def __exit__(self, *exc: object) -> None:
        return None
