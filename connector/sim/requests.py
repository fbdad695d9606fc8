"""The simulator's view of one request: its transfer, its faults, and each engine's side of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.connector.params import TransferParams, prompt_digest
from kvledger.connector.sim.faults import TransferFaults
from kvledger.ledger.events import ReqId, TransferId


@dataclass
class SideRecord:
    """One engine's vLLM request for the transfer."""

    request_id: ReqId
    needed: bool = True
    """False when this engine never gets the request (never_ready consumer, or an engine already dead)."""
    admit_round: int = -1
    admitted: bool = False
    arrived: bool = False
    """The consumer engine's vLLM has the request (on_new_request called); it waits until `admit_round`."""
    blocks: tuple[int, ...] = ()
    reported: int = 0
    """Times vLLM was told this side finished (finished_sending / finished_recving): must end at 1."""
    finished: bool = False
    """vLLM is done with the request: the storm at its first report; the soak once a consumer decoded (or a
    producer whose transfer id was refused was freed at once)."""
    failed: bool = False
    lost: bool = False
    """In flight on an engine when it died."""

    @property
    def resolved(self) -> bool:
        return not self.needed or self.lost or self.finished

    @property
    def hung(self) -> bool:
        return self.needed and not self.lost and not self.finished


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
    """The consumer request's params as vLLM keeps them: READ, what the producer's request_finished returned
    (through the proxy); WRITE, what the proxy gave it. Once `on_alloc` claimed the load, they say so."""
    handed_over: bool = False
    """The consumer may be scheduled: READ once the prefill finished (params or none), WRITE at once."""
    producer_params: TransferParams | None = None
    reuse_of: int | None = None
    """The soak's reused-id fault: the number of the request whose transfer id this one carries again."""

    @property
    def resolved(self) -> bool:
        return self.producer.resolved and self.consumer.resolved

    @property
    def prompt_digest(self) -> str:
        """Every simulated request has a prompt of its own (a reused transfer id brings another one)."""
        return prompt_digest((self.number,))

    @property
    def owner(self) -> TransferId:
        """The pools' owner tag of this request's blocks: its transfer id, made unique for a reused id (so a
        block freed by the wrong request of the pair is still a double free)."""
        return self.transfer_id if self.reuse_of is None else TransferId(f"{self.transfer_id}#{self.number}")
