"""The request parameters several routes share: the audit time, a transfer id in a path, the transfer-list
filters and paging, and the page-size bound."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

from fastapi import Path, Query

from kvledger.api.errors import InvalidBody
from kvledger.api.settings import Settings
from kvledger.ledger.limits import TRANSFER_ID_CHARS_MAX, TS_MAX

Now = Annotated[float | None, Query(ge=0, le=TS_MAX, description="Audit time (s since epoch); default: now")]
TransferIdPath = Annotated[
    str, Path(min_length=1, max_length=TRANSFER_ID_CHARS_MAX, pattern="^[^\x00]*$", description="A transfer id")
]
"""What a valid event's transfer id may be (kvledger.ledger.valid): anything else is 422, never a store error."""
RequestIdPath = Annotated[str, Path(min_length=1, max_length=200)]
"""A request id in a path (`/requests/{request_id}`), for both services."""
SourceFilter = Annotated[str | None, Query(max_length=200)]
RequestIdFilter = Annotated[str | None, Query(max_length=200)]
ModeFilter = Literal["read", "write"] | None
HasFindingFilter = Annotated[bool | None, Query(description="Only sides with (or without) a finding")]
Cursor = Annotated[int, Query(ge=0, le=1 << 62, description="From the previous page's next_cursor")]
Limit = Annotated[int, Query(ge=1, le=1 << 30)]
"""`GET /transfers`' filters and paging, as the one-process service and the partition workers' service take them."""


class HasSettings(Protocol):
    """The one-process service's `Live` or the partition workers' `Fleet`."""

    @property
    def settings(self) -> Settings: ...


def check_limit(service: HasSettings, limit: int) -> None:
    """A page asked for more rows than the settings allow is a 422 naming the bound."""
    if limit > service.settings.page_limit_max:
        raise InvalidBody(("query", "limit"), f"at most {service.settings.page_limit_max}, got {limit}")
