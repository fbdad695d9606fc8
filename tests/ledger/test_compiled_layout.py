"""ledger/structs.pxd, the C layout the compiled fold reads sides and events by (and a `--jobs` merge its claims),
names every field of each class in the order msgspec lays them out (a field added, removed or renamed without it
would have the compiled fold read the wrong one); and msgspec still lays Structs out that way (else the fold loads
interpreted). Runs on either build: it reads the declarations, not the compiled code."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

import kvledger.ledger
import kvledger.ledger.claims
import kvledger.ledger.events
import kvledger.ledger.transfer_state
from kvledger.ledger.compiled import struct_layout_holds

PXD = (Path(kvledger.ledger.__file__).parent / "structs.pxd").read_text()
"""Beside the package wherever it is loaded from (a checkout, or the mutation benchmark's copy)."""


def _declared() -> dict[str, list[str]]:
    """Class path -> its fields as the `ctypedef class` lines declare them, in order."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in PXD.splitlines():
        header = re.match(r"\s*ctypedef class ([\w.]+) \[object (\w+), check_size error\]:", line)
        if header:
            current = out[header.group(1)] = []
        elif field := re.match(r"\s+cdef object (\w+)$", line):
            current.append(field.group(1))
    return out


def _typedefs() -> dict[str, list[str]]:
    """C struct name -> its fields after the object header, as the verbatim C block declares them."""
    return {
        name: [f.strip().lstrip("*") for f in fields.split(",")]
        for fields, name in re.findall(r"typedef struct \{\s*PyObject_HEAD\s+PyObject\s+([^;]+);\s*\}\s*(\w+);", PXD)
    }


def _memory_order(cls: type[msgspec.Struct]) -> list[str]:
    """msgspec's layout: the base Struct's fields, then the class's own, each sorted by name."""
    base = next((b for b in cls.__mro__[1:] if issubclass(b, msgspec.Struct) and b.__struct_fields__), None)
    inherited = list(base.__struct_fields__) if base is not None else []
    own = [f for f in cls.__struct_fields__ if f not in inherited]
    return sorted(inherited) + sorted(own)


def test_msgspec_lays_structs_out_as_the_declarations_assume() -> None:
    assert struct_layout_holds()


def test_every_declared_class_names_all_its_fields_in_memory_order() -> None:
    declared = _declared()
    assert set(declared) == {
        "kvledger.ledger.transfer_state.TransferState",
        "kvledger.ledger.claims.Claim",
        "kvledger.ledger.claims.Free",
    } | {f"kvledger.ledger.events.{name}" for name in ("_Envelope", "Map", "Schedule", "Seal", "Ack", "Fail", "Expire")}
    modules = {
        "kvledger.ledger.transfer_state": kvledger.ledger.transfer_state,
        "kvledger.ledger.events": kvledger.ledger.events,
        "kvledger.ledger.claims": kvledger.ledger.claims,
    }
    for path, fields in declared.items():
        module, _, name = path.rpartition(".")
        assert fields == _memory_order(getattr(modules[module], name)), path


def test_the_c_structs_match_the_class_declarations() -> None:
    typedefs = _typedefs()
    for path, fields in _declared().items():
        assert typedefs[f"kvledger_{path.rpartition('.')[2]}"] == fields, path
