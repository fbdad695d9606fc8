"""Fuzz the ways in from outside: the JSONL reader (through `kvledger replay`'s own path), POST /events
and POST /replay, with logs and bodies that are mostly right and often not.

The reader either yields valid events or names the file and line (LogFormatError); ingest answers
200 or a 4xx and then wrote nothing; an upload is replayed or refused with a 4xx, and a replay the
service answers equals the command line's. Never another exception, never a 5xx.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.api.app import create_app
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Event
from kvledger.ledger.inputs import Inputs
from kvledger.ledger.jsonl import LogFormatError
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.valid import event_problem
from tests.api.conftest import TOKEN, settings_for
from tests.api.test_ingest import stored
from tests.fuzz.strategies import events, examples, log_bytes

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _replay(path: Path) -> int | str:
    """What `kvledger replay` makes of the file: its event count, or the error line it prints."""
    try:
        with Inputs([path]) as inputs:
            result = replay_chunks(inputs.chunks())
    except LogFormatError as error:
        assert error.path == str(path) and error.line >= 1
        return f"line {error.line}"
    audit(result.state, result.last_ts or 0.0)
    return result.events


@settings(FUZZ, max_examples=examples(200))
@given(data=log_bytes())
def test_the_reader_yields_valid_events_or_names_the_line(tmp_path_factory: Any, data: bytes) -> None:
    path = tmp_path_factory.mktemp("logs") / "fuzzed.jsonl"
    path.write_bytes(data)
    if data.startswith(b"SQLite format 3"):
        return  # a store file: test_replay_upload below sends these through the service
    outcome = _replay(path)
    if isinstance(outcome, int):
        with Inputs([path]) as inputs:
            assert all(event_problem(e) is None for e in inputs.events())
        return
    skipping = Inputs([path], skip_bad_lines=True)
    try:
        with skipping:
            kept = list(skipping.events())
    except LogFormatError as error:
        assert error.line == 1  # only a bad header stops a reader that skips bad lines
        return
    assert all(event_problem(e) is None for e in kept) and skipping.skipped


@st.composite
def ingest_bodies(draw: st.DrawFn) -> bytes:
    """A batch of events (valid, invalid, out of order), sometimes wrapped wrongly or cut short."""
    batch: list[Event] = draw(st.lists(events, max_size=6))
    body: Any = {"events": [msgspec.to_builtins(e) for e in batch]}
    shape = draw(st.sampled_from(["batch", "batch", "batch", "extra", "bare", "deep"]))
    if shape == "extra":
        body["extra"] = 1
    elif shape == "bare":
        body = body["events"]
    elif shape == "deep":
        body = {"events": [json.loads("[" * 200 + "]" * 200)]}
    raw = json.dumps(body).encode()  # NaN and infinity as JSON's non-standard literals: malformed
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


def test_ingest_answers_200_or_4xx_and_a_4xx_writes_nothing(sqlite_url: str) -> None:
    answers: dict[int, int] = {}
    with TestClient(create_app(settings_for(sqlite_url))) as client:

        @settings(FUZZ, max_examples=examples(150))
        @given(body=ingest_bodies())
        def run(body: bytes) -> None:
            before = stored(sqlite_url)
            answer = client.post("/events", content=body, headers=AUTH | {"Content-Type": "application/json"})
            answers[answer.status_code] = answers.get(answer.status_code, 0) + 1
            assert answer.status_code in (200, 409, 422), answer.text
            after = stored(sqlite_url)
            if answer.status_code == 200:
                assert after == before + answer.json()["inserted"]
            else:
                assert after == before  # nothing half-applied

        run()
    assert answers.get(200, 0) > 0 and answers.get(422, 0) > 0, answers  # both ways were exercised


def test_replay_upload_answers_like_the_command_line(sqlite_url: str, tmp_path: Path) -> None:
    answers: dict[int, int] = {}
    with TestClient(create_app(settings_for(sqlite_url))) as client:

        @settings(FUZZ, max_examples=examples(150))
        @given(data=log_bytes())
        def run(data: bytes) -> None:
            answer = client.post("/replay", content=data, headers={"Content-Type": "application/x-ndjson"})
            answers[answer.status_code] = answers.get(answer.status_code, 0) + 1
            assert answer.status_code in (200, 422), answer.text
            if data.startswith(b"SQLite format 3"):
                return
            path = tmp_path / "same.jsonl"
            path.write_bytes(data)
            expected = _replay(path)
            if answer.status_code == 200:
                assert answer.json()["events"] == expected
            else:
                assert answer.json()["detail"][0]["loc"] == ["body", expected]

        run()
    assert answers.get(200, 0) > 0 and answers.get(422, 0) > 0, answers
