"""Which partition a transfer's events belong to: the one function every splitter uses.

The unit of scale is a partition of the log by transfer (both sides of a transfer carry the same
`transfer_id`, so every per-transfer rule stays inside one partition). Replay's `--jobs`, the service's
parallel startup and the NATS subjects all split by this function, so a transfer lands in the same
partition everywhere. It is crc32 of the id's UTF-8 bytes, not Python's `hash`, which is salted per
process and would send one transfer to different partitions in different processes.
"""

from __future__ import annotations

import zlib

from kvledger.ledger.events import Drop, Event, TransferId


def partition_of(transfer_id: TransferId | str, partitions: int) -> int:
    """The partition, in `range(partitions)`, that holds every event of `transfer_id`."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    return zlib.crc32(transfer_id.encode("utf-8")) % partitions


def partition_of_event(event: Event, partitions: int) -> int:
    """The partition that folds `event`: its transfer's, and 0 for a `drop` (a forged control message names
    no side; partition 0 keeps the whole log's latest drops as one fold does)."""
    if type(event) is Drop:
        return 0
    return partition_of(event.transfer_id, partitions)


def rising_groups(
    events: list[Event], partitions: int, above: dict[str, int]
) -> dict[tuple[int, str], list[Event]] | None:
    """`events` by (`partition_of_event`, source), in batch order within each group and groups in the order of
    their first event, when each source's seqs rise through the batch from above `above[source]` (a
    writer's batch over what a store holds: nothing to look up); None otherwise. Compiled with the fold: a
    store's append runs it over every event it publishes."""
    groups: dict[tuple[int, str], list[Event]] = {}
    last = dict(above)
    of_transfer: dict[str, int] = {}  # a transfer's few events in a batch: its crc32 taken once
    for event in events:
        envelope = event  # compiled: the fields read as C struct members
        source = envelope.source
        seq = envelope.seq
        if seq <= last[source]:
            return None
        last[source] = seq
        if type(event) is Drop:
            partition = 0
        else:
            transfer_id = envelope.transfer_id
            partition = of_transfer.get(transfer_id, -1)
            if partition < 0:
                partition = of_transfer[transfer_id] = partition_of(transfer_id, partitions)
        key = (partition, source)
        members = groups.get(key)
        if members is None:
            groups[key] = [event]
        else:
            members.append(event)
    return groups
