"""What the scheduler half hands its workers each step (vLLM's connector metadata), as plain data."""

from __future__ import annotations

import msgspec

from kvledger.ledger.events import Mode, ReqId, TransferId

# The items are frozen and hold only strings, numbers, tuples and a PeerRef: they can make no cycle, so they
# are kept out of the garbage collector (`gc=False`), as the events are: no tracking on every item's
# allocation and free, on vLLM's step path.


class PeerRef(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A remote engine as named in params: host and *base* ports (ports.rank_port adds the rank)."""

    engine_id: str = ""
    host: str
    handshake_port: int
    notify_port: int
    tp_size: int = 1
    dp_rank: int = 0
    generations: tuple[int, ...] = ()
    """Each TP rank's generation (`connector/generation.py`), as the engine's scheduler learnt them from its
    workers: the life whose layout a transfer's reads may use. Empty: not named (nothing to check)."""

    def generation_of(self, tp_rank: int) -> int:
        """The generation these params name for rank `tp_rank` (0: none named)."""
        return self.generations[tp_rank] if tp_rank < len(self.generations) else 0

    @property
    def label(self) -> str:
        """The ledger's `peer` field: host and base notify port."""
        return f"{self.host}:{self.notify_port}"


class RecvItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Consumer: receive this transfer into `block_ids` (READ: pull from the peer; WRITE: tell it where)."""

    transfer_id: TransferId
    request_id: ReqId
    mode: Mode
    block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...] | None
    peer: PeerRef
    deadline: float
    prompt_digest: str | None = None
    """WRITE: the request's prompt digest, sent with remote_blocks for the producer to check."""
    block_groups: tuple[int, ...] | None = None
    """Hybrid models: `block_ids` per KV cache group, as counts (`kvledger.ledger.events.Map.block_groups`)."""
    remote_block_groups: tuple[int, ...] | None = None


class SendItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Producer, READ: hold `block_ids` for the consumer's reads until it releases them."""

    transfer_id: TransferId
    request_id: ReqId
    block_ids: tuple[int, ...]
    deadline: float
    block_groups: tuple[int, ...] | None = None


class SaveItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Producer, WRITE: this step's forward completes the prompt; write every layer to the consumer."""

    transfer_id: TransferId
    request_id: ReqId
    block_ids: tuple[int, ...]
    peer: PeerRef | None
    deadline: float
    prompt_digest: str | None = None
    """The request's prompt digest: remote_blocks naming another prompt are refused."""
    block_groups: tuple[int, ...] | None = None
    """Hybrid models: `block_ids` per KV cache group, as counts (`kvledger.ledger.events.Map.block_groups`)."""


class AbortItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Consumer aborted before allocation: tell the holder ranks to release at once."""

    transfer_id: TransferId
    request_id: ReqId
    peer: PeerRef


class FailItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Consumer: the scheduler half decided this receive failed (a refused peer, its deadline): the workers
    report it to vLLM (failed_recving, load errors), the one path vLLM reads before it trusts a load."""

    transfer_id: TransferId
    request_id: ReqId
    block_ids: tuple[int, ...]
    reason: str


class LeaseItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Consumer: this waiting transfer's lease is due for renewal; the workers tell its holder ranks."""

    transfer_id: TransferId
    peer: PeerRef


class StepMetadata(msgspec.Struct, kw_only=True):
    recv: list[RecvItem] = msgspec.field(default_factory=list)
    send: list[SendItem] = msgspec.field(default_factory=list)
    save: list[SaveItem] = msgspec.field(default_factory=list)
    abort: list[AbortItem] = msgspec.field(default_factory=list)
    failed: list[FailItem] = msgspec.field(default_factory=list)
    lease: list[LeaseItem] = msgspec.field(default_factory=list)

    def empty(self) -> bool:
        return not (self.recv or self.send or self.save or self.abort or self.failed or self.lease)
