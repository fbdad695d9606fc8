"""A source as a NATS subject token (`source_token`): one token, reversible, and the same remembered or not."""

from __future__ import annotations

from urllib.parse import unquote

from hypothesis import given
from hypothesis import strategies as st

from kvledger.ledger.store.nats_stream import SOURCE_TOKENS_CACHED, source_token

SUBJECT_UNSAFE = set(". *>\t\r\n")


@given(st.lists(st.text(max_size=12), min_size=1, max_size=SOURCE_TOKENS_CACHED // 256))
def test_a_token_is_one_subject_token_and_names_its_source_alone(sources: list[str]) -> None:
    for source in sources:
        token = source_token(source)
        assert token == source_token.__wrapped__(source)  # the memo changes the cost, never the answer
        assert token and not SUBJECT_UNSAFE & set(token)
        assert unquote(token) == source or (source == "" and token == "%")


def test_the_memo_forgets_beyond_its_size_and_still_answers_the_same() -> None:
    sources = [f"prefill-{n}/tp0" for n in range(SOURCE_TOKENS_CACHED * 2)]
    first = [source_token(s) for s in sources]
    assert source_token.cache_info().currsize <= SOURCE_TOKENS_CACHED
    assert [source_token(s) for s in sources] == first == [source_token.__wrapped__(s) for s in sources]
