"""Stamped transfer ids: ids that carry the time they were issued, so that the fold can judge an id by time
alone once it is older than any transfer can live (DESIGN.md, "Long runs"; `ID_WINDOW_S`).

The format, one: `tx-` followed by a UUIDv7 in RFC 9562's canonical text, lowercase
(`tx-0190f1e2-3c4d-7abc-8def-0123456789ab`): 48 bits of big-endian unix milliseconds, the version nibble 7,
12 random bits, the variant bits `10`, 62 random bits. Any other id is unstamped (a third-party proxy's
`uuid4`, a test's `tx-00000001`): the fold holds what it knows of unstamped ids exactly for as long as it
runs. Sans-IO: the caller reads the clock and the random source (proxy/app.py, the connector's scheduler).
"""

from __future__ import annotations

import math
import re

from kvledger.ledger.events import TransferId

PREFIX = "tx-"
_RAND_BITS = 74
"""rand_a (12 bits) and rand_b (62 bits)."""
_STAMPED = re.compile(r"tx-([0-9a-f]{8})-([0-9a-f]{4})-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", re.ASCII).fullmatch
"""The format: the prefix, the 48-bit time in two groups, the version nibble 7, the variant's high bits 10."""


def stamped_id(now_s: float, rand: bytes | int) -> TransferId:
    """The stamped id issued at `now_s` (unix seconds; milliseconds are kept) with `rand`'s low 74 bits (an
    int, or bytes read big-endian: 10 bytes from `os.urandom` are enough)."""
    if not (math.isfinite(now_s) and 0 <= now_s < (1 << 48) / 1000):
        raise ValueError(f"stamped_id: now_s must be unix seconds within 48 bits of milliseconds, got {now_s!r}")
    bits = int.from_bytes(rand, "big") if isinstance(rand, bytes) else rand
    if bits < 0:
        raise ValueError("stamped_id: rand must be >= 0")
    bits &= (1 << _RAND_BITS) - 1
    ms = int(now_s * 1000)
    rand_a, rand_b = bits >> 62, bits & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    h = f"{value:032x}"
    return TransferId(f"{PREFIX}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")


def issued_at(transfer_id: str) -> float | None:
    """When a stamped id was issued (unix seconds, to the millisecond); None for an unstamped id. One match
    (run for each side the fold first sees, so kept to about a microsecond)."""
    match = _STAMPED(transfer_id)
    return None if match is None else int(match[1] + match[2], 16) / 1000
