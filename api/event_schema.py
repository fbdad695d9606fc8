"""The OpenAPI schema of ledger events, generated from the ledger's msgspec structs (one definition),
with the bounds of a valid event (`kvledger.ledger.valid`) written in."""

from __future__ import annotations

from typing import Any

import msgspec

from kvledger.ledger.events import Event
from kvledger.ledger.limits import INT64_MAX, INT64_MIN, SOURCE_CHARS_MAX, TRANSFER_ID_CHARS_MAX, TS_MAX


def _bound_integers(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.setdefault("minimum", INT64_MIN)
            node.setdefault("maximum", INT64_MAX)
        for value in node.values():
            _bound_integers(value)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value)


def event_components() -> dict[str, Any]:
    """`Event` (a discriminated union on `kind`) and its six members, for `components.schemas`."""
    (union,), components = msgspec.json.schema_components([Event], ref_template="#/components/schemas/{name}")
    for schema in components.values():
        schema["properties"]["seq"] = {
            "type": "integer",
            "minimum": 1,
            "description": "Seq in `source`'s log",
        }
        schema["required"] = [*schema["required"], "seq"]
        for name in ("source", "transfer_id", "request_id"):
            if name in schema["properties"]:
                schema["properties"][name] |= {"minLength": 1, "pattern": "^[^\\x00]*$"}
        schema["properties"]["source"]["maxLength"] = SOURCE_CHARS_MAX
        schema["properties"]["transfer_id"]["maxLength"] = TRANSFER_ID_CHARS_MAX
        for name in ("ts", "deadline"):
            if name in schema["properties"]:
                schema["properties"][name] |= {"minimum": 0, "maximum": TS_MAX}
    _bound_integers(components)
    components["Event"] = union | {"description": "One ledger event, tagged on `kind`."}
    components["IngestBatch"] = {
        "type": "object",
        "properties": {"events": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}}},
        "required": ["events"],
        "additionalProperties": False,
    }
    return components


def add_event_components(openapi: dict[str, Any]) -> dict[str, Any]:
    openapi.setdefault("components", {}).setdefault("schemas", {}).update(event_components())
    return openapi
