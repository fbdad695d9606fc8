"""The read side over a seeded SQLite store, through FastAPI's TestClient: transfers, audit, tail, metrics."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.seed import AUDIT_NOW, CONSUMER, PRODUCER, START_TS


def test_health_and_ready(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["ready"] is True and ready["cursor"] == 9 and ready["error"] is None


def test_transfers_filters_and_pagination(client: TestClient) -> None:
    everything = client.get("/transfers").json()
    keys = [(t["source"], t["transfer_id"]) for t in everything["transfers"]]
    assert keys == [(PRODUCER, "tx-ok"), (CONSUMER, "tx-ok"), (PRODUCER, "tx-leak"), (PRODUCER, "tx-late")]
    assert everything["next_cursor"] is None
    held = client.get("/transfers", params={"phase": "held"}).json()["transfers"]
    assert [t["transfer_id"] for t in held] == ["tx-leak"]
    assert held[0]["live"] is True and held[0]["block_ids"] == [10, 11, 12, 13]
    consumers = client.get("/transfers", params={"source": CONSUMER, "mode": "read"}).json()["transfers"]
    assert [t["request_id"] for t in consumers] == ["c-ok"]
    flagged = client.get("/transfers", params={"has_finding": True, "now": AUDIT_NOW}).json()["transfers"]
    assert {t["transfer_id"] for t in flagged} == {"tx-leak", "tx-late"}
    by_request = client.get("/transfers", params={"request_id": "p-late"}).json()["transfers"]
    assert [t["phase"] for t in by_request] == ["expired"]
    seen, cursor = [], 0
    while cursor is not None:
        page = client.get("/transfers", params={"limit": 3, "cursor": cursor}).json()
        seen += [(t["source"], t["transfer_id"]) for t in page["transfers"]]
        cursor = page["next_cursor"]
    assert seen == keys


def test_transfer_detail_has_both_sides_and_the_timeline(client: TestClient) -> None:
    detail = client.get("/transfers/tx-ok").json()
    assert {s["source"]: s["phase"] for s in detail["sides"]} == {
        PRODUCER: "completed",
        CONSUMER: "completed",
    }
    assert [(e["source"], e["kind"]) for e in detail["timeline"]] == [
        (PRODUCER, "map"), (CONSUMER, "map"), (CONSUMER, "schedule"), (CONSUMER, "ack"), (PRODUCER, "ack"),
    ]  # fmt: skip
    producer = next(s for s in detail["sides"] if s["source"] == PRODUCER)
    assert producer["decision"]["cause"] == "completed" and producer["decision"]["seq"] == 2
    assert client.get("/transfers/nope").status_code == 404


def test_request_lookup(client: TestClient) -> None:
    sides = client.get("/requests/c-ok").json()["sides"]
    assert [(s["source"], s["transfer_id"], s["role"]) for s in sides] == [(CONSUMER, "tx-ok", "consumer")]
    assert client.get("/requests/unknown").status_code == 404


def test_audit_findings_with_evidence(client: TestClient) -> None:
    audit = client.get("/audit", params={"now": AUDIT_NOW}).json()
    codes = [(f["code"], f["transfer_id"]) for f in audit["findings"]]
    assert codes == [("leak", "tx-leak"), ("late_event", "tx-late")]
    assert audit["findings"][0]["evidence"] == [3] and audit["counts"]["leak"] == 1
    late = client.get("/audit", params={"now": AUDIT_NOW, "code": "late_event"}).json()
    assert late["total"] == 1 and late["findings"][0]["evidence"] == [6]
    early = client.get("/audit", params={"now": 1001.0}).json()
    assert early["counts"]["leak"] == 0


def test_summary_counts_holdings_and_advice(client: TestClient) -> None:
    summary = client.get("/audit/summary", params={"now": AUDIT_NOW}).json()
    assert summary["live_transfers"] == 1 and summary["blocks_held"] == 4
    # Silent ~1,000 s while holding blocks (over 3 transfer timeouts): the producer is lost, so what it
    # holds is gone with it, and no side is held on a live engine.
    assert list(summary["lost_sources"]) == [PRODUCER] and "silent for" in summary["lost_sources"][PRODUCER]
    assert summary["blocks_lost"] == 4 and summary["oldest_held"] is None
    assert summary["releases_by_cause"] == {"completed": 2, "failed": 0, "expired": 1}
    assert summary["ack_latency_s"]["p50"] is not None
    assert "too short" in summary["timeout_advice"]


def test_the_oldest_side_held_is_on_a_live_engine(client: TestClient) -> None:
    # A minute in: the leak's deadline passed, its engine spoke 58 s ago (under 3 transfer timeouts): live.
    summary = client.get("/audit/summary", params={"now": START_TS + 60}).json()
    assert summary["lost_sources"] == {} and summary["blocks_lost"] == 0
    oldest = summary["oldest_held"]
    assert (oldest["source"], oldest["transfer_id"], oldest["blocks"]) == (PRODUCER, "tx-leak", 4)
    assert oldest["age_s"] == 60 - (oldest["first_ts"] - START_TS)


def test_events_tail_pages_by_store_cursor(client: TestClient) -> None:
    first = client.get("/events", params={"limit": 4}).json()
    assert [row["cursor"] for row in first["events"]] == [1, 2, 3, 4]
    rest = client.get("/events", params={"after_seq": first["next_after_seq"], "limit": 100}).json()
    assert [row["cursor"] for row in rest["events"]] == [5, 6, 7, 8, 9]
    assert rest["events"][0]["event"]["kind"] == "ack"


def test_metrics_exposition(client: TestClient) -> None:
    text = client.get("/metrics").text
    assert 'kvledger_events_total{kind="map"} 4.0' in text
    assert "kvledger_live_transfers 1.0" in text
    assert "kvledger_blocks_held 4.0" in text
    assert 'kvledger_findings{code="leak",severity="error"} 1.0' in text
    assert 'kvledger_release_latency_seconds_count{cause="completed"} 2.0' in text
    assert 'kvledger_live_transfers_by_phase{phase="held"} 1.0' in text
    # The leak's source has written nothing since 1970 while holding 4 blocks: lost, not leaking.
    assert "kvledger_sources_lost 1.0" in text and "kvledger_blocks_lost 4.0" in text


def test_two_apps_have_separate_registries(seeded_url: str) -> None:
    from kvledger.api.app import create_app
    from tests.api.conftest import settings_for

    with (
        TestClient(create_app(settings_for(seeded_url))) as one,
        TestClient(create_app(settings_for(seeded_url))) as two,
    ):
        assert one.get("/metrics").text.count("kvledger_blocks_held 4.0") == 1
        assert two.get("/metrics").text.count("kvledger_blocks_held 4.0") == 1


def test_web_pages(client: TestClient) -> None:
    page = client.get("/", params={"now": AUDIT_NOW})
    assert page.status_code == 200 and "tx-leak" in page.text and "leak" in page.text
    timeline = client.get("/ui/transfers/tx-late", params={"now": AUDIT_NOW})
    assert timeline.status_code == 200 and "released (expired)" in timeline.text and "<svg" in timeline.text
    assert client.get("/ui/transfers/nope").status_code == 404
    assert client.get("/", params={"now": "soon"}).status_code == 422


def test_the_published_audit_s_answers_are_those_of_the_same_audit_asked_at_its_time(client: TestClient) -> None:
    """`GET /audit` without `?now=` answers from the published audit, each query's answer serialized once
    (`PublishedAnswers`): byte for byte what the same audit asked at its time (`?now=`, computed and
    serialized on the request) says, for every code and several limits, asked twice."""
    queries = [{}, {"limit": 1}, {"limit": 2}] + [{"code": code} for code in ("leak", "late_event", "stuck")]
    for params in queries * 2:
        kept = client.get("/audit", params=params)
        at = kept.json()["now"]  # the published audit's time (the clock may have moved on since the last)
        assert kept.content == client.get("/audit", params={**params, "now": at}).content
        assert kept.headers["content-type"] == "application/json"
    assert any(client.get("/audit", params=q).json()["findings"] for q in queries)  # not all empty
