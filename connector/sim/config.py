"""What a storm is asked to do (`StormConfig`) and what it found (`StormResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeAlias

from kvledger.connector.config import ConnectorConfig, PeerEngine
from kvledger.connector.limits import TRANSPORT_INFLIGHT_MAX
from kvledger.ledger.events import Mode, Role

FaultKind: TypeAlias = Literal[
    "sq_full", "transfer_fail", "drop", "duplicate", "reorder", "late", "early", "never_ready", "peer_death",
    "forged_release", "late_reader",
    "peer_restart_layout",
    "silent_peer",
]  # fmt: skip
FAULT_KINDS: tuple[FaultKind, ...] = (
    "sq_full", "transfer_fail", "drop", "duplicate", "reorder", "late", "early", "never_ready", "peer_death",
    "forged_release", "late_reader",
    "peer_restart_layout",
    "silent_peer",
)  # fmt: skip
"""sq_full: a burst of send-queue-full (transient) transport failures; transfer_fail: a terminal transport
failure; drop / duplicate / reorder / late: a notification lost, delivered twice, held a few rounds, or held
past every deadline; early: the producer worker binds a transfer late, so the consumer's release (READ) or
remote_blocks (WRITE) reaches it before its map; never_ready: the consumer never takes the request (a READ
consumer that never reads, a WRITE consumer that never sends remote_blocks); peer_death: one engine dies
mid-run (its worker closes; its scheduler stops); forged_release: someone on an allow-listed address (the
loopback) sends the producer a `release` for the transfer without the storm's control key; late_reader: the
consumer request waits in a decode backlog and starts its read (READ) or sends remote_blocks (WRITE) after
the producer's defer deadline (leases must keep the blocks held, or the read must be refused);
peer_restart_layout: once, the engine whose KV the other moves (READ: the producer; WRITE: the consumer) dies and
comes back on the same ports with another KV layout (twice the blocks: every V run moves): no transfer may move
bytes with the layout the other engine learnt from its first life;
silent_peer: the transfer's transport requests go to a peer that takes them and never answers (`sim/silent.py`):
each holds an in-flight slot of the real tcp transport until the transfer is decided; no other transfer may be
refused a slot for it, and every slot must come back."""


@dataclass(frozen=True)
class StormConfig:
    seed: int = 1
    mode: Mode = "read"
    requests: int = 2000
    concurrency: int = 512
    faults: frozenset[FaultKind] = frozenset(FAULT_KINDS)
    fault_rate: float = 0.02
    """Probability, per transfer and per enabled kind (peer_death: once per run), that the fault is injected."""
    layers: int = 2
    blocks_per_request: int = 2
    block_size: int = 4
    kv_heads: int = 1
    head_dim: int = 8
    mamba_layers: int = 0
    """Hybrid Mamba requests: this many Mamba layers beside the attention ones, each request holding one Mamba
    state block (its own KV cache group, from the same pool) moved, held and released with its attention blocks.
    In WRITE mode the forward saves the attention layers only (vLLM calls save_kv_layer for attention layers):
    the state is written after it, from wait_for_save."""
    num_blocks: int = 0
    """KV blocks per engine; 0 picks concurrency x blocks a request holds x 2."""
    step_s: float = 0.01
    """Simulated seconds per round."""
    start_ts: float = 1_700_000_000.0
    transfer_timeout_s: float = 1.0
    defer_timeout_s: float = 2.0
    recv_abort_timeout_s: float = 3.0
    """Longer than defer_timeout: the producer gives up before the consumer, so no write lands in blocks the
    consumer has already handed back."""
    kv_lease_duration_s: float = 1.2
    """Leases at the storm's scale (defer 2 s): renewed every 0.2 s, a crashed consumer's hold lapses 1.2 s
    after its last renewal."""
    kv_lease_max_s: float = 8.0
    """Longer than the latest late reader waits (defer + proxy delay + 4 s)."""
    transport_inflight_max: int = TRANSPORT_INFLIGHT_MAX
    """In-flight requests each engine's tcp transport allows, to all peers together (a quarter of it per peer, as
    the limits' are). With `protections` off the transport is as it was (one bound over every peer, no deadline)
    and the connector never gives a request up: silent_peer's negative control runs this small, so that the
    slots the silent peer keeps starve every other transfer."""
    protections: bool = True
    """False: the negative control. No leases, reads of released blocks served, and engines that name no
    generation (the connector as it was): late readers then receive other requests' KV (checksums) and the
    audit finds premature releases; after peer_restart_layout the new life's KV is moved with the old layout."""
    start_load_before_forward: bool = False
    """vLLM (0.33) calls start_load_kv after launching the forward when no load is synchronous, as here;
    True steps the workers in the older order (start_load_kv first)."""
    ledger_url: str | None = None
    """Persist each source's ledger there (a fresh store: transfer ids repeat across runs)."""
    incident_log: Path | None = None
    """Write the merged JSONL incident log (all four sources) there."""

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {list(FAULT_KINDS)}")
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("requests and concurrency must be >= 1")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate}")
        if self.transport_inflight_max < 1:
            raise ValueError(f"transport_inflight_max must be >= 1, got {self.transport_inflight_max}")
        if self.mamba_layers < 0:
            raise ValueError(f"mamba_layers must be >= 0, got {self.mamba_layers}")
        if self.num_blocks and self.num_blocks < self.concurrency * self.blocks_held:
            raise ValueError("num_blocks must hold concurrency x the blocks a request holds")
        if not self.transfer_timeout_s < self.defer_timeout_s < self.recv_abort_timeout_s:
            raise ValueError("timeouts must be ordered: transfer < defer < recv_abort")

    @property
    def state_blocks(self) -> int:
        """Mamba state blocks per request: the running state, one for every Mamba layer (0 without Mamba)."""
        return 1 if self.mamba_layers else 0

    @property
    def blocks_held(self) -> int:
        """Blocks a request holds: its attention blocks, then its Mamba state block."""
        return self.blocks_per_request + self.state_blocks

    @property
    def block_groups(self) -> tuple[int, ...] | None:
        """Each KV cache group's count in a request's blocks (None: one group)."""
        return (self.blocks_per_request, self.state_blocks) if self.state_blocks else None

    @property
    def blocks(self) -> int:
        return self.num_blocks or self.concurrency * self.blocks_held * 2


@dataclass
class StormResult:
    """Every figure of one storm. `problems` lists each broken invariant in words; empty means it passed."""

    seed: int
    mode: Mode
    requests: int
    concurrency: int
    unserved_requests: int = 0
    """Requests never issued: a dead READ producer leaves the proxy nobody to prefill them."""
    rounds: int = 0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    events: int = 0
    faults_injected: dict[str, int] = field(default_factory=dict)
    finished_sending: int = 0
    finished_recving: int = 0
    failed_recving: int = 0
    leaked_blocks: int = 0
    """Blocks still allocated at the end, on engines that are alive."""
    double_releases: int = 0
    """A request reported finished twice, or a block freed that was not allocated."""
    premature_releases: int = 0
    """`premature_release` findings over the merged log."""
    hung_requests: int = 0
    """Request sides (a producer's or a consumer's) never reported finished, on engines that are alive."""
    dead_engine: str | None = None
    """The engine the storm killed (`peer_death`), if it killed one."""
    lost_requests: int = 0
    """Request sides in flight on an engine when it died: gone with it, neither finished nor hung."""
    integrity_checked: int = 0
    integrity_failures: int = 0
    """Completed receives whose bytes differ from the producer's (per-block checksums)."""
    failed_reported_as_received: int = 0
    """Receives known to have failed that were reported without a load error."""
    findings: dict[str, int] = field(default_factory=dict)
    """Audit findings over the merged log at the end, by code (what `kvledger replay` reports)."""
    findings_on_dead_engine: dict[str, int] = field(default_factory=dict)
    """Of those, the ones on the engine that died (what it held when it died)."""
    unexplained_findings: list[str] = field(default_factory=list)
    """Findings on transfers no injected fault touched (must be empty)."""
    late_faults_unreported: list[str] = field(default_factory=list)
    """Transfers whose notification was held past the deadline with no late_event finding (must be empty)."""
    replay_matches: bool = False
    naive_leaked_blocks: int = 0
    naive_hung_requests: int = 0
    naive_dropped_acks: int = 0
    fingerprint: str = ""
    """A digest of every transfer's events (seqs left out): equal for equal seeds, across processes."""
    incident_log: str | None = None
    forged_sent: int = 0
    """Forged `release` messages sent to the producer (the forged_release fault)."""
    forged_messages_accepted: int = 0
    """Of those, the ones not recorded as dropped (`drop` events): must be 0."""
    late_reads: int = 0
    """Consumers (late_reader) that started after their producer's defer deadline."""
    late_reads_refused: int = 0
    """Reads (or remote_blocks) refused because the producer no longer held the transfer (read_refused)."""
    lease_renewals: int = 0
    """Lease renewals the producer worker folded."""
    lease_expiries: int = 0
    """Producer sides expired after a missed lease."""
    silent_requests: int = 0
    """Transport requests sent to the silent peer (silent_peer)."""
    starved_transfers: int = 0
    """Transfers no fault touched that the tcp transport refused an in-flight slot and whose receive then
    failed: another peer's requests held the slots (must be 0)."""
    inflight_leaked: int = 0
    """In-flight slots of live engines' tcp transports still held at the end, when every request was answered or
    given up (must be 0)."""
    hook_us_max: float = 0.0
    """The longest wall time any one hook call took, in microseconds (a peer never makes a hook wait)."""
    stale_links: int = 0
    """Links a transfer found to be of another life of its peer than it names (peer_restart_layout), forgotten
    and handshaken again before any byte moved."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def corrupt_receives(self) -> int:
        """Receives reported good whose bytes are not the producer's (the checksums): wrong answers."""
        return self.integrity_failures


HOST = "127.0.0.1"
STORM_CONTROL_KEY = b"kvledger-storm-control-key-0001"
"""Both engines sign their control messages with it; a forged_release is sent without it."""


def engine_config(storm: StormConfig, role: Role, mine: list[int], theirs: list[int]) -> ConnectorConfig:
    peer = PeerEngine(host=HOST, handshake_port=theirs[0], notify_port=theirs[1], transport_port=theirs[2])
    return ConnectorConfig(
        role=role,
        mode=storm.mode,
        engine_id="prefill-0" if role == "producer" else "decode-0",
        host=HOST,
        handshake_port=mine[0],
        notify_port=mine[1],
        transport_port=mine[2],
        transfer_timeout_s=storm.transfer_timeout_s,
        defer_timeout_s=storm.defer_timeout_s,
        recv_abort_timeout_s=storm.recv_abort_timeout_s,
        ledger_url=storm.ledger_url,
        peers=(peer,),
        control_key=STORM_CONTROL_KEY,
        kv_lease_duration_s=storm.kv_lease_duration_s if storm.protections else 0.0,
        kv_lease_max_s=storm.kv_lease_max_s,
        refuse_released_reads=storm.protections,
    )
