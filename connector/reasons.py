"""The words of the connector's `fail` events, one home for each (the fold reads the fail's `code`, never
these; they are for people, logs and the page). A reason is `WORD` or `WORD: detail`."""

from __future__ import annotations

REASON_LAYOUT = "layout_mismatch"
REASON_READ_REFUSED = "read_refused"
"""The words of a `read_refused` fail (its code says it to the fold)."""
REASON_TRANSIENT_TIMEOUT = "transient_failures_past_transfer_timeout"
REASON_PEER_UNLINKED = "peer_not_linked"
"""A transfer waited a transfer timeout for its peer's handshake: the reason names the peer (the log says why)."""
REASON_PEER_NOT_ALLOWED = "peer_not_allowed"
"""A peer outside the allow-list (`peers` in the config), named by either half."""
REASON_PEER_RESTARTED = "peer_restarted"
"""The transfer names a life (generation) of its peer that is over, or that the peer's handshake does not
answer as: its KV is in a layout no link has, so it is never read or written (a load error)."""
REASON_TRANSPORT = "transport_error"
"""The transport raised (connect, read or write) instead of returning a failed status."""
REASON_NOT_SENT = "notification_not_sent"
REASON_WAIT_FULL = "too_many_transfers_waiting_for_links"
REASON_ABORTED_BEFORE_ALLOCATION = "aborted_before_allocation"
"""A consumer request that ended before it had blocks: the producer is told to release; vLLM already forgot it."""

REASON_WORKER_RECV_FAILED = "worker_recv_failed"
REASON_ENGINE_RESTARTED = "engine_restarted"
"""Why a side the previous process left live was failed when this one started."""
