"""Schemathesis against the app's own OpenAPI schema over real HTTP: valid and invalid inputs, no 5xx ever."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from kvledger.api.app import create_app
from tests.api.conftest import TOKEN, ServerThread, seed, settings_for

EXAMPLES_PER_OPERATION_MAX = 30


@pytest.mark.slow
def test_no_server_errors_on_generated_requests(sqlite_url: str) -> None:
    seed(sqlite_url)
    cases: Counter[str] = Counter()
    server_errors: list[str] = []
    # Streams end at once here: a generated request must not hold the fuzzer for the default duration.
    with ServerThread(create_app(settings_for(sqlite_url, stream_duration_max_s=0.05))) as base:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        for operation in operations:
            label = operation.label
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=EXAMPLES_PER_OPERATION_MAX,
                    deadline=None,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                def run(case: schemathesis.Case) -> None:
                    headers = {"Authorization": f"Bearer {TOKEN}"} if case.method == "POST" else None
                    response = case.call(base_url=base, headers=headers, timeout=30)
                    cases[label] += 1  # noqa: B023  (each run() is called before the loop moves on)
                    if response.status_code >= 500:
                        server_errors.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                             f"{response.text[:300]}")  # fmt: skip

                try:
                    run()
                except Unsatisfiable:
                    # An operation without parameters or body (GET /healthz) has no invalid input to make.
                    assert mode is GenerationMode.NEGATIVE, operation.label
    print(f"\nschemathesis: {sum(cases.values())} generated cases over {len(cases)} operations, "
          f"{len(server_errors)} server errors")  # fmt: skip
    assert len(operations) >= 10
    assert server_errors == []
