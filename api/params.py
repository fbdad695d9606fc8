"""The request parameters several routes share: the audit time, a transfer id in a path, and the page-size bound."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from kvledger.api.errors import InvalidBody
from kvledger.api.live import Live
from kvledger.ledger.limits import TRANSFER_ID_CHARS_MAX, TS_MAX

Now = Annotated[float | None, Query(ge=0, le=TS_MAX, description="Audit time (s since epoch); default: now")]
TransferIdPath = Annotated[
    str, Path(min_length=1, max_length=TRANSFER_ID_CHARS_MAX, pattern="^[^\x00]*$", description="A transfer id")
]
"""What a valid event's transfer id may be (kvledger.ledger.valid): anything else is 422, never a store error."""


def check_limit(live: Live, limit: int) -> None:
    """A page asked for more rows than the settings allow is a 422 naming the bound."""
    if limit > live.settings.page_limit_max:
        raise InvalidBody(("query", "limit"), f"at most {live.settings.page_limit_max}, got {limit}")
