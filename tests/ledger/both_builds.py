"""What one build of the fold decides and finds on generated histories, as one digest per seed: the
compiled fold and the interpreted one (KVLEDGER_INTERPRETED=1, a subprocess) must print the same.

Run: python -m tests.ledger.both_builds FIRST_SEED COUNT [--full]. Prints one JSON line: whether the fold
that ran is compiled, and per seed the sha256 of everything below (with --full, the plain data itself,
to find where two builds part).

Per seed, one unkind history (tests/ledger/histories.py, its shape drawn from the seed, the domains of
the property tests) and one synthetic run with faults (ledger/synth.py), each folded three ways:
- whole (`fold_all`): every release in order, every side's plain view, the indexes and counts, and the
  audit's findings at moments on its boundaries;
- replayed with compaction after every few events and a tombstone bound small enough to be hit
  (the upkeep: tombstones, recall, eviction, the id memory);
- through a running `Ledger` that forgets decided sides as the connector does, then snapshotted and
  restored (what the store keeps);
- as the service folds the store's rows (`kvledger.ledger.projection.fold_rows`): its releases and latencies, the
  sides' order, the request index, the counts by kind, each source's newest ts and the holding series.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Sequence
from typing import Any
from unittest import mock

import msgspec

import kvledger.ledger.upkeep as upkeep_module
from kvledger.ledger.audit import audit
from kvledger.ledger.compiled import compiled
from kvledger.ledger.events import Event
from kvledger.ledger.fold import LedgerState, fold_all
from kvledger.ledger.ledger import Ledger
from kvledger.ledger.merge import batched
from kvledger.ledger.replay import replay_chunks
from kvledger.ledger.series import HoldingSeries
from kvledger.ledger.store import snapshot
from kvledger.ledger.synth import SynthConfig, generate
from tests.ledger.builders import ServiceFold
from tests.ledger.histories import Shape, audit_moments, history
from tests.ledger.reference import canonical

BATCH = 7
"""Events per append or replay chunk: small, so upkeep runs between decisions."""


def _shape(rng: random.Random) -> Shape:
    """A shape from the domains tests/ledger/test_reference_oracle.py draws from, and sometimes longer."""
    return Shape(
        transfers=rng.randint(1, 24) if rng.random() < 0.8 else rng.randint(60, 200),
        span_s=rng.choice([5.0, 40.0, 120.0, 600.0]),
        faults_per_side=rng.choice([0.5, 1.0, 2.0, 4.0]),
        reuse_rate=rng.choice([0.0, 0.15, 0.4]),
        orphan_rate=rng.choice([0.0, 0.1, 0.3]),
        premature_rate=rng.choice([0.0, 0.3]),
        overfull_rate=rng.choice([0.0, 0.1]),
        late_gap_s=rng.choice([5.0, 30.0, 200.0]),
        block_pool=rng.randint(3, 64),
        producers=rng.choice([("prefill-0/tp0",), ("prefill-0/tp0", "prefill-1/tp0")]),
        consumers=rng.choice([("decode-0/tp0",), ("decode-0/tp0", "decode-1/tp0")]),
    )


def _plain(value: Any) -> Any:
    """JSON-able data in a fixed order (sets sorted, structs as their fields, dicts as item lists)."""
    if isinstance(value, msgspec.Struct):
        return [type(value).__name__, *(_plain(getattr(value, f)) for f in value.__struct_fields__)]
    if isinstance(value, dict):
        return [[_plain(k), _plain(v)] for k, v in value.items()]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _state(state: LedgerState, events: list[Event], seed: int) -> dict[str, Any]:
    """A state's decisions, sides, indexes, counts and findings."""
    return {
        "sides": [[list(key), t.snapshot()] for key, t in state.transfers.items()],
        "live": list(state.live),
        "unmapped": list(state.unmapped),
        "held": {source: sorted(blocks) for source, blocks in state.held.items()},
        "contested": list(state.contested.items()),
        "double_owned": list(state.double_owned.items()),
        "anomalous": list(state.anomalous),
        "retrying": list(state.retrying),
        "deadlines": sorted(d[:4] for d in state.deadlines),  # the sides are in "sides"
        "decided": [(ts, (source, tid)) for ts, source, tid, _ in state.decided],
        "counts": [
            state.releases_by_cause,
            state.blocks_held,
            state.lease_counts,
            state.forged_by_reason,
            state.compacted_by_phase,
            state.compacted_by_mode,
            state.tombstone_count,
            state.tombstones_evicted,
            state.orphans_evicted,
            state.late_after_eviction,
            state.reused_after_eviction,
        ],
        "tombstones": sorted(state.tombstones) + sorted(state.tombstones_old),
        "findings": [canonical(audit(state, now)) for now in audit_moments(events, random.Random(seed))],
    }


def _folded(events: list[Event], seed: int) -> dict[str, Any]:
    state, releases = fold_all(events)
    with mock.patch.object(upkeep_module, "TOMBSTONES_MAX", 8):  # read when a state is made
        replayed = replay_chunks(batched(events, BATCH), compact_every=3)
    by_source: dict[str, list[Event]] = {}
    for event in events:
        by_source.setdefault(event.source, []).append(event)
    running: dict[str, Any] = {}
    for source, own in by_source.items():
        lg = Ledger(source)
        for i in range(0, len(own), BATCH):
            lg.extend([msgspec.structs.replace(e, seq=0) for e in own[i : i + BATCH]])
            lg.maintain(own[min(i + BATCH, len(own)) - 1].ts, retain_s=10.0)
        restored = snapshot.decode(snapshot.encode(lg.state))
        running[source] = [lg.take_releases(), _state(restored, own, seed)]
    return {
        "releases": releases,
        "whole": _state(state, events, seed),
        "replayed": [replayed.releases, _state(replayed.state, events, seed)],
        "running": running,
        "projected": _projected(events),
    }


def _projected(events: list[Event]) -> dict[str, Any]:
    """The service's fold of the events as stored rows, in chunks of BATCH."""
    kept = ServiceFold(HoldingSeries(points_max=8, bucket_s=0.5))  # few buckets: it widens
    failed = []
    for i in range(0, len(events), BATCH):
        failed += kept.fold(events[i : i + BATCH])
    return {
        "failed": [(cursor, repr(error)) for cursor, _, error in failed],
        "told": kept.told,
        "order": kept.order,
        "by_request": kept.by_request,
        "by_kind": kept.by_kind,
        "last_ts": kept.last_ts,
        "holding": kept.holding.to_plain(),
        "latency": kept.latency.to_plain(),
    }


def run(seed: int) -> dict[str, Any]:
    """Everything one build decides and finds for `seed`."""
    rng = random.Random(seed)
    unkind = history(seed, _shape(rng))
    synth = list(generate(SynthConfig(transfers=rng.randint(20, 120), concurrency=16, fault_rate=0.2), seed=seed))
    return {"unkind": _folded(unkind, seed), "synth": _folded(synth, seed)}


def digests(seeds: Sequence[int], *, full: bool = False) -> list[Any]:
    """Per seed, the sha256 of `run(seed)` as JSON (with `full`, the data itself)."""
    out: list[Any] = []
    for seed in seeds:
        data = _plain(run(seed))
        out.append(data if full else hashlib.sha256(json.dumps(data).encode()).hexdigest())
    return out


def main(argv: Sequence[str]) -> None:
    first, count = int(argv[0]), int(argv[1])
    full = "--full" in argv
    print(json.dumps({"compiled": compiled(), "digests": digests(range(first, first + count), full=full)}))


if __name__ == "__main__":
    main(sys.argv[1:])
