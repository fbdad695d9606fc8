"""A read of the stream ends at the last message it held when the read began, whatever the messages' `num_pending`
says: the server was seen to count one message too many there, and a read that believed it waited for a message
the stream did not hold until it failed (`StoreUnavailable`). Here every delivered message counts one too many."""

from __future__ import annotations

import dataclasses

import pytest
from nats.aio.msg import Msg

from kvledger.ledger.store.connect import open_store
from kvledger.ledger.store.nats_store import NatsStore
from tests.ledger.builders import Side

pytestmark = pytest.mark.nats


def test_reads_end_at_the_last_message_though_num_pending_counts_one_more(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(nats_url, create=True)
    assert isinstance(store, NatsStore)
    try:
        side = Side("prefill-0/tp0")
        store.append([side.map(f"tx-{i}", f"r-{i}") for i in range(40)])
        before = store.tail(0, 1000)
        store.append([side.map(f"tx-late-{i}", f"r-late-{i}") for i in range(3)])
        real = Msg.metadata.fget
        assert real is not None

        def one_too_many(msg: Msg) -> Msg.Metadata:
            metadata = real(msg)
            return dataclasses.replace(metadata, num_pending=metadata.num_pending + 1)

        monkeypatch.setattr(Msg, "metadata", property(one_too_many))
        late = store.tail(before[-1][0], 2)  # each fetch asks for one or two messages: the count is believed
        everything = store.tail(0, 1000)
        assert len(everything) == 43 and everything[:40] == before and late == everything[40:42]
        assert store.tail(everything[-1][0], 10) == []  # past the last message: nothing, and no wait
        assert store.count() == 43  # a headers-only scan of the whole stream
    finally:
        store.close()
