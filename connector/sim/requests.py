"""The simulator's view of one request: its transfer, its faults, and each engine's side of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.params import TransferParams
from connector.sim.faults import TransferFaults
from ledger.events import ReqId, TransferId


@dataclass
class SideRecord:
    """One engine's vLLM request for the transfer."""

    request_id: ReqId
    needed: bool = True
    """False when this engine never gets the request (never_ready consumer, or an engine already dead)."""
    admit_round: int = -1
    admitted: bool = False
    blocks: tuple[int, ...] = ()
    reported: int = 0
    """Times vLLM was told this side finished (finished_sending / finished_recving): must end at 1."""
    failed: bool = False
    lost: bool = False
    """In flight on an engine when it died."""

    @property
    def resolved(self) -> bool:
        return not self.needed or self.lost or self.reported > 0

    @property
    def hung(self) -> bool:
        return self.needed and self.admitted and not self.lost and self.reported == 0


@dataclass
class SimRequest:
    number: int
    transfer_id: TransferId
    faults: TransferFaults
    producer: SideRecord
    consumer: SideRecord
    checksums: list[int] = field(default_factory=list)
    """The producer's block checksums after its prefill: what the consumer must end up holding."""
    consumer_params: TransferParams | None = None
    """READ: what the producer's request_finished returned, for the proxy to hand to the consumer."""
    producer_params: TransferParams | None = None

    @property
    def resolved(self) -> bool:
        return self.producer.resolved and self.consumer.resolved
