"""Every named limit of the P/D simulator, in one place (units last)."""

from __future__ import annotations

SETTLE_TIMEOUT_S = 20.0
"""Real seconds a round may wait for its bytes and messages to land; past it the run fails (never hangs)."""

SETTLE_POLL_S = 0.0002
"""Real seconds between looks at a channel's receive counter while settling (a message is ~100 us away)."""

ROUNDS_MAX = 20_000
"""Rounds a storm may take; a run that needs more is reported as hung, not waited on."""

TAIL_ROUNDS = 3
"""Rounds stepped after everything is resolved, so that the last messages land and get recorded."""

ARRIVALS_PER_ROUND_MAX = 128
"""New requests admitted per round, as vLLM's scheduler admits a bounded batch per step; it also keeps one
round's transport requests under ZMQ's default high-water mark (1000), past which a ROUTER drops replies."""

LAG_ROUNDS_MIN = 5
LAG_ROUNDS_MAX = 8
"""How many steps late a producer worker binds a transfer's metadata (the `early` fault): more than the
proxy delay plus a read and its release take, far less than transfer_timeout (an orphan's expiry)."""

REORDER_ROUNDS_MAX = 4
"""The most rounds a `reorder` fault holds a notification back."""

LATE_READER_PAST_DEADLINE_ROUNDS_MIN = 25
LATE_READER_PAST_DEADLINE_ROUNDS_MAX = 400
"""How far past the producer's defer deadline a `late_reader` consumer starts its read (READ) or sends
remote_blocks (WRITE): 0.25 s to 4 s at 10 ms a round, an eighth of the defer timeout to twice it (the
decode backlog of seconds to minutes against a 60 s defer_timeout, at the storm's scale)."""

PROXY_DELAY_ROUNDS_MAX = 2
"""The most rounds the proxy takes to hand a request to the second engine."""

SQ_FULL_BURST_OPS_MAX = 8
"""Transport ops a send-queue-full burst fails; a tenth of bursts are endless (they outlast transfer_timeout)."""

SQ_FULL_ENDLESS_OPS = 1_000_000
"""An endless burst: the retries give up at transfer_timeout and the failure becomes terminal."""

PORT_ATTEMPTS_MAX = 5
"""Tries at binding both engines on freshly chosen ports before giving up (another program took one)."""

PORTS_PER_ENGINE = 3
"""handshake, notify and transport."""

# -- the soak (connector/sim/soak.py) ---------------------------------------------

REUSE_IN_FLIGHT_SHARE = 0.5
"""Of the follow-up reuses armed while their first transfer is still in flight, the share sent at once."""

REUSE_SOON_MIN_S = 0.2
REUSE_SOON_MAX_S = 3.0
"""A follow-up reuse arrives this long after the request whose transfer id it carries: while the first owner
is live or its decided side is still held whole."""

REUSE_MINUTES_MIN_S = 60.0
REUSE_MINUTES_MAX_S = 1800.0
REUSE_HOURS_MIN_S = 3600.0
"""A burst request that reuses an id picks one issued this long before: minutes (compacted, inside or past its
id window) or hours (past it: refused by time, ledger/upkeep.py)."""

DEATH_IN_BURST_MIN_S = 0.02
DEATH_IN_BURST_MAX_S = 1.5
"""An engine dies this long after a burst began: with the burst's transfers in flight."""

PREEMPT_AFTER_MIN_S = 0.5
"""A decoding request is preempted at least this long after it started decoding."""

SOAK_REPLAY_COMPACT_EVERY = 512
"""Events between compactions in the soak's third offline replay: many more compactions than the default."""

SOAK_ROUNDS_MAX = 5_000_000
"""Rounds a soak may step; the clock jumps over idle time, so a few hundred thousand cover hours."""
