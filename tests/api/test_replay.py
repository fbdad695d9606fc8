"""POST /replay: JSONL and SQLite uploads folded offline, cut at a seq or ts; the live store untouched."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from kvledger.api.app import create_app
from kvledger.ledger.jsonl import write_log
from kvledger.ledger.store.connect import open_store
from tests.api.conftest import settings_for
from tests.api.seed import incident_events


def _jsonl(tmp_path: Path) -> bytes:
    path = tmp_path / "incident.jsonl"
    write_log(path, incident_events())
    return path.read_bytes()


def test_replay_jsonl_upload(client: TestClient, tmp_path: Path) -> None:
    before = client.get("/readyz").json()["cursor"]
    result = client.post("/replay", content=_jsonl(tmp_path), headers={"Content-Type": "application/x-ndjson"}).json()
    assert result["events"] == 9 and result["transfers"] == 4
    assert result["releases_by_cause"] == {"completed": 2, "failed": 0, "expired": 1}
    assert [d["transfer_id"] for d in result["decisions"]] == ["tx-ok", "tx-ok", "tx-late"]
    assert result["now"] == 1002.0  # the last event's ts: a replay never reads the server's clock
    assert result["counts"]["late_event"] == 1
    assert client.get("/readyz").json()["cursor"] == before


def test_replay_until_seq_and_until_ts(client: TestClient, tmp_path: Path) -> None:
    log = _jsonl(tmp_path)
    cut = client.post("/replay", params={"until_seq": 2}, content=log).json()
    assert cut["events"] == 4 and cut["decisions_total"] == 1
    later = client.post("/replay", params={"until_ts": 2000.0}, content=log).json()
    assert later["now"] == 2000.0 and later["counts"]["leak"] == 1


def test_replay_sqlite_ledger_file(client: TestClient, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/incident.db"
    store = open_store(url, create=True)
    store.append(incident_events())
    store.close()
    data = (tmp_path / "incident.db").read_bytes()
    result = client.post("/replay", content=data, headers={"Content-Type": "application/octet-stream"}).json()
    assert result["events"] == 9 and result["live_transfers"] == 1


def test_bad_logs_are_422_naming_the_line(client: TestClient, tmp_path: Path) -> None:
    log = _jsonl(tmp_path).splitlines(keepends=True)
    broken = b"".join([*log[:3], b'{"kind": "map", "seq": "one"}\n', *log[3:]])
    response = client.post("/replay", content=broken)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "line 4"]
    assert client.post("/replay", content=b"").status_code == 422
    assert client.post("/replay", content=b"SQLite format 3\x00garbage").status_code == 422


def test_oversized_upload_is_413(seeded_url: str) -> None:
    with TestClient(create_app(settings_for(seeded_url, replay_body_bytes_max=1024))) as test_client:
        response = test_client.post("/replay", content=b"x" * 5000)
    assert response.status_code == 413
