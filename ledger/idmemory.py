"""Transfer sides once mapped and since forgotten entirely, remembered approximately in bounded memory.

The fold refuses a second `map` of a `(source, transfer_id)` that was ever mapped
(DESIGN.md, "Long runs"). While a side or its tombstone is held, the answer is
exact. Past the tombstone limit the key lives on only here: a generational Bloom
filter, `ID_MEMORY_GENERATIONS` generations of `ID_MEMORY_GENERATION_IDS` keys each.

- False positives: a key never mapped may be taken for one that was, with a
  probability below `ID_MEMORY_FALSE_POSITIVE_MAX` per lookup (the bound is
  checked in tests/ledger/test_id_memory.py). A refused fresh transfer is served
  without a remote transfer: slower, never wrong.
- False negatives: none for the last `(ID_MEMORY_GENERATIONS - 1) *
  ID_MEMORY_GENERATION_IDS` keys added (1.8 million sides compacted after the one
  asked about), and none for any key while its generation is held (up to
  `ID_MEMORY_GENERATIONS * ID_MEMORY_GENERATION_IDS`); older keys are new again.

Hashing is `key_hash` below (64-bit FNV-1a over the key's code points, finished with MurmurHash3's
64-bit mixer), never Python's `hash` (salted per process): the live connector and an offline replay
must take the same false positives. Compiled, it is a C loop over the strings (about 80 instructions
for a 20-character id, where blake2b of an encoded f-string cost about 1,500 in object calls); the
false-positive bound below is checked with it (tests/ledger/test_id_memory.py).

Only mapped sides are remembered here: a false positive may refuse a fresh transfer (safe) but
must never release one (a never-mapped side that expired is kept exactly, in the fold's
`orphan_tombstones`).
"""

from __future__ import annotations

from collections import deque

from kvledger.ledger.limits import (
    ID_MEMORY_BITS_PER_ID,
    ID_MEMORY_GENERATION_IDS,
    ID_MEMORY_GENERATIONS,
    ID_MEMORY_HASHES,
)

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = 0xFFFFFFFFFFFFFFFF
_FMIX_FIRST = 0xFF51AFD7ED558CCD
_FMIX_SECOND = 0xC4CEB9FE1A85EC53
"""fmix64's multipliers: names, not literals, so that compiled they are the 64-bit C constants ledger/idmemory.pxd
declares (a literal past 2**63 would be a Python int, and the product Python arithmetic)."""
_STEP_SALT = 0x9E3779B97F4A7C15
"""XORed into the hash before the second mixing: the step of the double hashing is independent of the start."""


def fmix64(h: int) -> int:
    """MurmurHash3's 64-bit finalizer: every input bit moves about half of the output bits (FNV-1a alone
    leaves the low bits, which pick the filter's positions, weakly mixed)."""
    h ^= h >> 33
    h = (h * _FMIX_FIRST) & _MASK64
    h ^= h >> 33
    h = (h * _FMIX_SECOND) & _MASK64
    h ^= h >> 33
    return h


def key_hash(source: str, transfer_id: str) -> int:
    """64-bit FNV-1a over the code points of `source`, a 0, and `transfer_id`, then `fmix64`: the same
    number compiled (C integers, wrapping at 2**64) and interpreted (masked to 64 bits)."""
    h = _FNV_OFFSET
    for ch in source:
        h = ((h ^ ord(ch)) * _FNV_PRIME) & _MASK64
    h = (h * _FNV_PRIME) & _MASK64  # the separator, code point 0: XOR with 0 changes nothing
    for ch in transfer_id:
        h = ((h ^ ord(ch)) * _FNV_PRIME) & _MASK64
    return fmix64(h)


def step_of(h: int) -> int:
    """The double hashing's step for a key of hash `h`: odd, so the positions never collapse onto one."""
    return fmix64(h ^ _STEP_SALT) | 1


class IdMemory:
    """A set of `(source, transfer_id)` keys with no false negatives within its horizon (see the module)."""

    def __init__(
        self,
        generation_ids: int = ID_MEMORY_GENERATION_IDS,
        generations: int = ID_MEMORY_GENERATIONS,
        *,
        bits_per_id: int = ID_MEMORY_BITS_PER_ID,
        hashes: int = ID_MEMORY_HASHES,
    ) -> None:
        if generation_ids < 1 or generations < 1 or bits_per_id < 1 or hashes < 1:
            raise ValueError("IdMemory sizes must be >= 1")
        bits = 1 << max(3, (generation_ids * bits_per_id - 1).bit_length())  # a power of two: positions by mask
        self.generation_ids = generation_ids
        self.generations = generations
        self.hashes = hashes
        self.mask = bits - 1
        self.current = bytearray(bits >> 3)
        self.count = 0
        """Keys added to the current generation."""
        self.older: deque[bytearray] = deque(maxlen=generations - 1)
        """Full generations, newest first; the oldest falls off when a new one is sealed."""
        self.added = 0
        """Keys added in all (a counter for reports)."""

    def add(self, source: str, transfer_id: str) -> None:
        if self.count >= self.generation_ids:
            # Sealed only when the next key comes: a full generation is still searched until then.
            if self.generations > 1:
                self.older.appendleft(self.current)
                self.current = bytearray(len(self.current))
            else:
                self.current[:] = bytes(len(self.current))
            self.count = 0
        # Position i is `h + i * step` (Kirsch-Mitzenmacher double hashing).
        position = key_hash(source, transfer_id)
        _set_bits(self.current, position, step_of(position), self.mask, self.hashes)
        self.count += 1
        self.added += 1

    def contains(self, source: str, transfer_id: str) -> bool:
        position = key_hash(source, transfer_id)
        step = step_of(position)
        mask, hashes = self.mask, self.hashes
        if self.count and _has_bits(self.current, position, step, mask, hashes):
            return True  # the current generation is searched only once it holds a key
        for bits in self.older:  # noqa: SIM110 (a loop: compiled, C; `any` of a generator would not be)
            if _has_bits(bits, position, step, mask, hashes):
                return True
        return False

    def to_plain(self) -> tuple[int, int, int, int, int, list[bytes]]:
        """Sizes, counters and the generations, newest first (for snapshots)."""
        return (
            self.generation_ids,
            self.generations,
            self.hashes,
            self.count,
            self.added,
            [bytes(self.current), *map(bytes, self.older)],
        )

    @classmethod
    def from_plain(cls, plain: tuple[int, int, int, int, int, list[bytes]]) -> IdMemory:
        generation_ids, generations, hashes, count, added, blooms = plain
        size = len(blooms[0]) if blooms else 0
        if size < 1 or size & (size - 1) or any(len(bloom) != size for bloom in blooms):
            raise ValueError("IdMemory generations must be equal powers of two in size")
        if len(blooms) > generations:
            raise ValueError(f"IdMemory holds {len(blooms)} generations, more than its {generations}")
        memory = cls(generation_ids, generations, bits_per_id=1, hashes=hashes)
        memory.mask = size * 8 - 1
        memory.current = bytearray(blooms[0])
        memory.older.extend(bytearray(bloom) for bloom in blooms[1:])
        memory.count, memory.added = count, added
        return memory


# The bit loops, apart: compiled (ledger/idmemory.pxd) they run on 64-bit C integers. `(position + step) &
# mask` is the same there: mask is below 2**64, so a sum that wraps at 2**64 keeps the bits it keeps.


def _set_bits(bits: bytearray, position: int, step: int, mask: int, hashes: int) -> None:
    for _ in range(hashes):  # one loop, no list: this runs for every side compacted
        position = (position + step) & mask
        bits[position >> 3] |= 1 << (position & 7)


def _has_bits(bits: bytearray, position: int, step: int, mask: int, hashes: int) -> bool:
    for _ in range(hashes):
        position = (position + step) & mask
        if not bits[position >> 3] & (1 << (position & 7)):
            return False
    return True
