"""Every named limit of the connector, in one place (TigerBeetle style: units last).

The timeouts the fold and the audits read too (`transfer_timeout`, `defer_timeout`) are the ledger's
(`ledger/limits.py`); those only the connector reads are here."""

from __future__ import annotations

DEFAULT_KV_LEASE_DURATION_S = 30.0
"""NIXL's `kv_lease_duration`: a consumer still waiting renews the producer's hold every sixth of it, and
each renewal holds the blocks for this long from its receipt; a consumer that stops renewing (a crashed
decode) is expired one lease after its last renewal. 0 turns leases off."""

LEASE_RENEWALS_PER_LEASE = 6
"""Renewals a waiting consumer sends per lease (NIXL's heartbeat interval is a sixth of the lease): five
can be lost before the hold lapses."""

DEFAULT_KV_LEASE_MAX_S = 480.0
"""The longest a producer holds a transfer however often it is renewed (NIXL's abort timeout): the bound on
what a consumer that renews for ever, but never reads, can strand. The scheduler half's deadline with leases
on (its backstop should its worker die)."""

LEASES_TRACKED_MAX = 65536
"""Waiting consumer requests a scheduler half renews for; beyond it a new one is not renewed (counted): it
may then find its producer expired, which is a refused read and a recompute, never wrong KV."""

LEASE_IDS_PER_MESSAGE_MAX = 4096
"""Transfer ids one lease message names (~40 bytes each, far below MESSAGE_BYTES_MAX); more go in more messages.
A received lease naming more is refused as malformed (counted `dropped_malformed`), never handled in part."""

DEFAULT_RECV_ABORT_TIMEOUT_S = 120.0
"""How long a consumer waits for its KV before giving the blocks back (failed load)."""

DEFAULT_HANDSHAKE_PORT = 6301
"""MoRIIO's default handshake port (base; ranks add their offset)."""

DEFAULT_NOTIFY_PORT = 61005
"""MoRIIO's default notify port (base; ranks add their offset)."""

DEFAULT_TRANSPORT_PORT = 62005
"""Base port of the tcp transport's data listener (ranks add their offset)."""

PORT_MAX = 65535

FREE_PORT_MIN = 20_000
"""Tests and the simulator take loopback ports from here up to the ephemeral range (clear of
well-known services such as PostgreSQL on 5432)."""

EPHEMERAL_PORT_LOW_DEFAULT = 32_768
"""Linux's default start of the ephemeral range, where `ip_local_port_range` cannot be read."""

MESSAGE_VERSION = 6
"""Wire version of every notification message; a message with another version is dropped (3: the `mac`; 4: the
`receiver` every message is signed for, a lease renewal's `sender`; 5: remote_blocks' `block_groups`; 6: every
message's `generation`, its sender's life)."""

FORGED_RECORDS_MAX = 1024
"""Dropped (forged or unlisted) control messages a channel keeps for the worker's next poll to record."""

REFUSALS_LOGGED_PER_SENDER = 3
"""Refused control messages a channel logs one by one for each sender; after these it only counts them (each is
still a counter and a `drop` event): whoever can reach the port cannot flood the engine's log."""

REFUSAL_SENDERS_LOGGED_MAX = 1024
"""Senders a channel keeps a refusal count for; refusals from senders past these are counted, not logged."""

MESSAGE_BYTES_MAX = 1 << 20
"""A notification larger than this is counted and dropped (a block list of 100k ids is ~500 KB)."""

MESSAGE_BYTES_HARD_MAX = 4 * MESSAGE_BYTES_MAX
"""ZMQ drops (and disconnects) above this before we ever see the bytes: a memory guard."""

CHANNEL_INBOX_MAX = 65536
"""Decoded notifications waiting for the worker's next poll; beyond this they are dropped and counted."""

CHANNEL_POLL_MS = 50
"""How often the listener thread looks at its stop flag."""

HANDSHAKE_TIMEOUT_S = 5.0
"""How long a dialer waits for a peer's handshake metadata."""

TRANSPORT_POLL_MS = 1
"""How long the tcp transport's I/O threads sleep in poll when idle (latency of a new request)."""

TRANSPORT_STAGING_BYTES = 16 << 20
"""Bytes of one staging buffer of the tcp transport (device regions' bytes go through host memory): a chunk
of a request larger than this is staged on its own. 16 MiB takes ~8 ms on a 2 GB/s wire, so a chunk's fixed
costs (a kernel launch, one stream sync: tens of us) stay under 1% of it; a layer's blocks of one request
(the issue's 32-256 MiB over 8-32 layers: at most 8 MiB) fit one chunk. Per transport: one device buffer
and TRANSPORT_STAGING_BUFFERS + 1 pinned host buffers per I/O thread (two threads), allocated on first use:
32 MiB of device memory and 96 MiB pinned at this size."""

TRANSPORT_STAGING_BUFFERS = 2
"""Pinned send buffers per I/O thread: zmq sends one request's slices from one while the next request (a
WRITE's next layer) is gathered into the other. With both still on the wire, a chunk is staged into a one-off
host buffer (counted, never waited for): its memory is bounded by zmq's queue as any queued message is."""

TRANSPORT_STAGING_INDEX_MAX = 1 << 18
"""Most index entries of one device-side gather (an int64 each: 2 MiB). A chunk's ops are gathered in units
of the largest size dividing every offset and size (a KV block's bytes, typically); ops so ragged that a chunk
needs more units than this are copied op by op on the device instead (still one host copy and one sync)."""

TRANSPORT_FRAME_BYTES_MAX = 64 << 20
"""Largest single op the tcp transport accepts (a KV block of one layer is far below this)."""

TRANSPORT_OPS_PER_REQUEST_MAX = 65536
"""Largest number of (local, remote, size) ops in one tcp request."""

TRANSPORT_INFLIGHT_MAX = 4096
"""Requests a tcp transport client may have outstanding, to all peers together; more fail transiently
(SEND_QUEUE_FULL) until a slot frees: at a reply, at the request's deadline, or when its caller gives up."""

TRANSPORT_INFLIGHT_PER_PEER_MAX = 1024
"""Requests a tcp transport client may have outstanding to one peer: a silent peer holds at most this many
slots (until their deadlines pass), and the others keep the rest of TRANSPORT_INFLIGHT_MAX."""

TRANSPORT_REQUEST_TIMEOUT_S = 30.0
"""A tcp request's deadline where its creator names none (the worker gives its transfer timeout): past it the
request fails (TIMEOUT), its slot is freed and a late reply is dropped."""

TRANSPORT_SWEEP_S = 0.01
"""How often the tcp client thread looks for requests past their deadline or given up by their caller."""

RETRY_BACKOFF_MIN_S = 0.001
RETRY_BACKOFF_MAX_S = 0.050
"""MoRIIO's backoff for a transient (send-queue-full) failure: 1 ms doubling up to 50 ms."""

PEERS_MAX = 1024
"""Peer engines a configuration may list."""

FIGURES_LATENCY_SAMPLES_MAX = 4096
"""Ack and release latency samples one stats report carries (vLLM takes a report every step); the rest of
a larger step are not sampled."""

FIGURES_AUDIT_INTERVAL_S = 1.0
"""How often the stats' findings by code are audited anew (vLLM takes stats every step; the audit is
proportional to live transfers, so it is not run on every step)."""

REMOTE_DIRECTORY_MAX = 65536
"""Remote block lists (WRITE mode) a producer worker keeps for transfers it has not mapped or finished."""

STOP_JOIN_TIMEOUT_S = 2.0
"""How long shutdown waits for a listener or transport thread to end."""

# mori transport (mori.io RDMA/XGMI); values follow vLLM's MoRIIO engine setup.
MORI_QP_PER_TRANSFER = 4
MORI_POST_BATCH_SIZE = -1
MORI_WORKER_THREADS = 4
"""RDMA backend settings, MoRIIO's defaults (-1: mori picks the batch size)."""

MORI_OPS_PER_BATCH_MAX = 65536
"""Largest number of (local, remote, size) ops in one batch_read/batch_write."""

MORI_INFLIGHT_MAX = 4096
"""Batches a transport may have in flight; beyond this new work fails transiently, like a full send queue."""

MORI_WAIT_SLICE_S = 0.05
"""Longest single native wait inside a handle's wait, so that a close from another thread is seen."""

MORI_POLL_INTERVAL_S = 0.001
"""Sleep between polls of a status that cannot be waited on natively (an old mori without WaitFor)."""

MORI_CLOSE_GRACE_S = 2.0
"""How long close waits for in-flight batches before deregistering memory the NIC may still be writing."""

HOOK_CALL_BOUND_S = 0.005
"""The longest any vLLM hook may take, whatever the peers do: no hook waits on a peer (handshakes run on
the linker's threads, sends never block, transport ops are asynchronous), so a hook's time is its own CPU
work. The storm and the benchmark measure it against this bound (`hook_us_max_dead_peer`)."""

LINK_BACKOFF_MIN_S = 0.1
LINK_BACKOFF_MAX_S = 5.0
"""After a failed handshake the next attempt to that peer waits, doubling from the minimum to the maximum
(never longer than the transfer timeout): a dead peer costs one background attempt per backoff, not one
per layer per transfer per step."""

POLL_IDS_MAX = 512
"""Transfer ids one poll handles from peers' messages (a message counts the ids it names, at least one: a lease
renewal up to LEASE_IDS_PER_MESSAGE_MAX); the rest wait, in order, for the next poll (a message half handled
is carried over, never dropped). A hook's work then stays bounded however many ids the peers send: each id
costs a few microseconds (a lookup, at most one event folded, a release acted on), so 512 stay near 1-2 ms
compiled and 4 ms interpreted, under HOOK_CALL_BOUND_S; vLLM polls twice a step, so a worker still takes
some 1,000 ids a step, more than the renewals of LEASES_TRACKED_MAX waiting requests need (a sixth of them
every sixth of a lease)."""

POLL_DROPS_MAX = 128
"""Refused (unproven) control messages one poll records as `drop` events; the rest wait in the channel
(FORGED_RECORDS_MAX of them, older ones counted and forgotten), so a forged flood costs a poll a bounded
number of events on top of POLL_IDS_MAX."""

UNMAPPED_SIDES_MAX = 1024
"""Never-mapped sides a worker's ledger holds open (an ack or fail that came before its map, kept for the map
it waits for) before a peer's release, write_done or write_failed naming an id this rank never mapped is
counted (`unknown_ids_refused`) and not recorded. A legitimate one comes before its map only while the
scheduler's metadata is a step away (an abort before allocation, a producer worker binding late): a few
per step, far below this. Past it, such a message is a stale or hostile peer's, and recording each would make
every one a side in the fold and two events (its ack, then its expiry): a flood of 20,000 would be 40,000
events. Refusing one is safe: a producer then holds its blocks to their deadline, a consumer fails its load
at its timeout; never a release too early."""

LINK_WAIT_MAX = 65536
"""Transfers that may wait at once for their peer to link; beyond this a new one fails at once."""

LINK_GENERATIONS_ENDED_MAX = 16
"""Per peer rank, the generations the linker saw end (a handshake answered with another): a transfer naming
one fails at once instead of handshaking again. Older ones are forgotten: a transfer naming one then costs
one more handshake before it fails."""

HMAC_KEY_BYTES_MIN = 16
"""The shortest control-message key accepted (a shorter one is a configuration error)."""

HMAC_KEY_BYTES_MAX = 4096
"""The longest control-message key accepted: a key file is read this far and no further (a path naming a
large file by mistake is a configuration error, not a read of the whole file)."""
