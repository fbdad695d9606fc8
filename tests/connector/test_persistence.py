"""`ledger_url`: a connector's ledger is drained to the store, and a restarted one continues it."""

from __future__ import annotations

from pathlib import Path

from kvledger.connector.config import ConnectorConfig
from kvledger.connector.ports import free_loopback_ports
from kvledger.connector.store import open_ledger, spill_dir
from kvledger.ledger.decisions import Release
from kvledger.ledger.events import Event, Map, ReqId, TransferId
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.url import parse_url
from tests.connector.pd import EnginePorts, make_config


def _config(url: str) -> ConnectorConfig:
    p = free_loopback_ports(6)
    return make_config("producer", "read", EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5]), ledger_url=url)


def _map(ledger: Ledger, i: int) -> tuple[Event, Release | None]:
    return ledger.record(
        Map, transfer_id=TransferId(f"tx-{i}"), request_id=ReqId(f"p-{i}"), role="producer", mode="read",
        block_ids=(i,), deadline=4e9, acks_expected=1,
    )  # fmt: skip


def test_events_reach_the_store_and_a_restart_continues_the_log(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    config = _config(url)
    ledger = open_ledger(config, "prefill-0/tp0")
    for i in range(50):
        _map(ledger, i)
    ledger.close()  # what the connector's shutdown does: flush the writer
    store = open_store(url)
    assert [e.seq for e in store.read(source="prefill-0/tp0")] == list(range(1, 51))
    assert list(store.read(source="prefill-0/tp0")) == list(ledger.log.since(0))
    store.close()

    again = open_ledger(config, "prefill-0/tp0")
    assert again.log.next_seq == 51
    assert len(again.state.live) == 50 and again.state.blocks_held == 50
    event, _ = _map(again, 50)
    assert event.seq == 51
    again.close()
    assert spill_dir(parse_url(url), "prefill-0/tp0") == Path(f"{tmp_path}/ledger.db.spill/prefill-0_tp0")


def test_a_bare_path_store_spills_next_to_its_file(tmp_path: Path) -> None:
    """A bare file path is a SQLite store (as everywhere a store URL is read): its spill folder lies beside
    that file, as for `sqlite:///`, not under the working directory's `kvledger-spill/`."""
    bare = str(tmp_path / "ledger.db")
    assert spill_dir(parse_url(bare), "decode-0/tp1") == tmp_path / "ledger.db.spill" / "decode-0_tp1"
    assert spill_dir(parse_url(f"sqlite:///{bare}"), "decode-0/tp1") == spill_dir(parse_url(bare), "decode-0/tp1")
    assert spill_dir(parse_url("postgresql://u@h/db"), "decode-0/tp1") == Path("kvledger-spill/decode-0_tp1")
    ledger = open_ledger(_config(bare), "decode-0/tp1")
    _map(ledger, 1)
    ledger.close()
    assert (tmp_path / "ledger.db").is_file()


def test_memory_url_keeps_the_ledger_in_memory(tmp_path: Path) -> None:
    ledger = open_ledger(_config("memory://"), "decode-0/tp0")
    _map(ledger, 1)
    ledger.close()
    assert ledger.log.next_seq == 2
    assert not list(tmp_path.iterdir())
