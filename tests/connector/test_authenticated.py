"""Peers prove who they are (issue 13, item 4): control messages carry an HMAC under a shared key.

Real ZMQ on loopback. A forged message is one sent from an allow-listed address (127.0.0.1) without the
key, or with another key: it is dropped, counted, recorded as a `drop` event and shown by the audit as a
`forged_message` finding; nothing acts on it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvledger.connector import messages
from kvledger.connector.channel import REFUSED_LOGGER, Channel
from kvledger.connector.config import ConfigError, from_extra_config
from kvledger.connector.limits import MESSAGE_VERSION, REFUSALS_LOGGED_PER_SENDER
from kvledger.connector.messages import RankAddress, ReleaseBlocks
from kvledger.connector.params import parse_params
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.audit import audit
from kvledger.ledger.events import Drop, ReqId, TransferId
from tests.connector.pd import EnginePorts, Side, Ticks, make_config, run_until

KEY = b"k" * 32
OTHER_KEY = b"x" * 32
WAIT_S = 10.0


def _wait_for(condition: Callable[[], bool]) -> bool:
    """Poll until `condition` holds (the listener thread is real); a bound on waiting, not a timed assertion."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def test_a_signed_message_verifies_and_any_change_breaks_it() -> None:
    release = ReleaseBlocks(transfer_id=TransferId("tx-1"), rank=0, consumer_tp_size=1)
    signed = messages.sign(release, KEY)
    assert signed.mac and signed.version == MESSAGE_VERSION == 6
    assert messages.authentic(signed, KEY)
    assert not messages.authentic(release, KEY)  # no MAC
    assert not messages.authentic(signed, OTHER_KEY)  # another key
    assert not messages.authentic(msgspec.structs.replace(signed, rank=1), KEY)  # content changed
    assert not messages.authentic(msgspec.structs.replace(signed, generation=7), KEY)  # the sender's life changed
    decoded = messages.decode(messages.encode(signed))
    assert isinstance(decoded, ReleaseBlocks) and messages.authentic(decoded, KEY)
    assert messages.authentic(release, None)  # without a key every message passes (and start says so)


def _raw_send(port: int, message: messages.Message) -> None:
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(messages.encode(message))
    finally:
        sock.close()
        context.term()


def test_the_channel_drops_and_counts_unsigned_and_wrongly_signed_messages() -> None:
    hs, notify = free_loopback_ports(2)
    listener = Channel("127.0.0.1", hs, notify, lambda host, port: True, key=KEY, may_receive_from=lambda h: True)
    friend = Channel("127.0.0.1", 0, 0, lambda host, port: True, key=KEY)
    stranger = Channel("127.0.0.1", 0, 0, lambda host, port: True, key=OTHER_KEY)
    try:
        forged = ReleaseBlocks(transfer_id=TransferId("tx-forged"), rank=0, consumer_tp_size=1)
        _raw_send(notify, forged)  # no MAC at all
        assert stranger.send("127.0.0.1", notify, forged)  # a MAC under another key
        good = ReleaseBlocks(transfer_id=TransferId("tx-good"), rank=0, consumer_tp_size=1)
        assert friend.send("127.0.0.1", notify, good)
        assert _wait_for(lambda: listener.counters["received"] == 1 and listener.counters["dropped_bad_mac"] == 2)
        (delivered,) = listener.drain()
        assert delivered.transfer_id == "tx-good" and messages.authentic(delivered, KEY)
        dropped = listener.take_dropped()
        assert [(d.message_type, d.transfer_id, d.reason) for d in dropped] == [("release", "tx-forged", "bad_mac")] * 2
        assert dropped[0].sender == "127.0.0.1"
    finally:
        for channel in (listener, friend, stranger):
            channel.close()


def test_a_flood_of_forged_messages_logs_the_first_few_and_counts_and_records_them_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hs, notify = free_loopback_ports(2)
    flood = REFUSALS_LOGGED_PER_SENDER + 4
    with caplog.at_level(logging.WARNING, logger=REFUSED_LOGGER):
        listener = Channel("127.0.0.1", hs, notify, lambda host, port: True, key=KEY, may_receive_from=lambda h: True)
        try:
            for i in range(flood):
                _raw_send(notify, ReleaseBlocks(transfer_id=TransferId(f"tx-{i}"), rank=0, consumer_tp_size=1))
            assert _wait_for(lambda: listener.counters["dropped_bad_mac"] == flood)
            assert [d.transfer_id for d in listener.take_dropped()] == [f"tx-{i}" for i in range(flood)]
        finally:
            listener.close()
    logged = [r.getMessage() for r in caplog.records if r.name == REFUSED_LOGGER]
    assert len(logged) == REFUSALS_LOGGED_PER_SENDER, logged
    assert all(line.startswith("release from 127.0.0.1 dropped: bad_mac") for line in logged)
    assert "further refusals from 127.0.0.1 are counted" in logged[-1] and "not logged" in logged[-1]


def test_a_sender_outside_the_allow_list_is_dropped_even_with_the_key() -> None:
    hs, notify = free_loopback_ports(2)
    listener = Channel("127.0.0.1", hs, notify, lambda h, p: True, key=KEY, may_receive_from=lambda h: h == "10.9.9.9")
    friend = Channel("127.0.0.1", 0, 0, lambda host, port: True, key=KEY)
    try:
        assert friend.send("127.0.0.1", notify, ReleaseBlocks(transfer_id=TransferId("t"), rank=0, consumer_tp_size=1))
        assert _wait_for(lambda: listener.counters["dropped_sender_not_allowed"] == 1)
        assert listener.drain() == []
    finally:
        friend.close()
        listener.close()


def test_handshake_metadata_under_another_key_is_refused() -> None:
    from kvledger.connector.transports.base import TransportEndpoint

    hs, notify = free_loopback_ports(2)
    listener = Channel("127.0.0.1", hs, notify, lambda host, port: True, key=OTHER_KEY)
    listener.set_metadata(
        messages.HandshakeMetadata(
            engine_id="p",
            dp_rank=0,
            tp_rank=0,
            tp_size=1,
            endpoint=TransportEndpoint(backend="tcp", host="127.0.0.1", port=1),
            layers=(),
        )
    )
    dialer = Channel("127.0.0.1", 0, 0, lambda host, port: True, key=KEY)
    me = RankAddress(engine_id="d", host="127.0.0.1", handshake_port=1, notify_port=2)
    try:
        # The listener drops the request (its MAC is under KEY), so the dialer waits its timeout for nothing.
        assert dialer.handshake("127.0.0.1", hs, me, timeout_s=0.5) is None
        assert _wait_for(lambda: listener.counters["dropped_bad_mac"] == 1)
    finally:
        dialer.close()
        listener.close()


def test_a_forged_release_never_frees_the_producer_and_shows_in_the_audit() -> None:
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Side.build(make_config("producer", "read", prod, cons, control_key=KEY), fill=True, seed=1)
    consumer = Side.build(make_config("consumer", "read", cons, prod, control_key=KEY), fill=False, seed=2)
    try:
        clock = Ticks()
        params = parse_params({"transfer_id": "tx-auth", "do_remote_decode": True})
        _, kv = producer.scheduler.on_request_finished(ReqId("p-a"), params, (0, 1, 2, 3), clock())
        producer.finished_pending.add(ReqId("p-a"))
        producer.step(clock())  # mapped on the worker
        _raw_send(prod.notify, ReleaseBlocks(transfer_id=TransferId("tx-auth"), rank=0, consumer_tp_size=1))
        run_until([producer], lambda: producer.worker.counters["forged_messages_dropped"] == 1, clock=clock)
        assert not producer.reported_sending  # the forged release freed nothing
        (drop,) = [e for e in producer.worker.ledger.log.since(0) if isinstance(e, Drop)]
        assert (drop.transfer_id, drop.message, drop.reason) == ("tx-auth", "release", "bad_mac")
        findings = [f for f in audit(producer.worker.state, clock.now) if f.code == "forged_message"]
        assert [(f.transfer_id, f.evidence) for f in findings] == [("tx-auth", (drop.seq,))]
        assert producer.worker.state.forged_by_reason == {"bad_mac": 1}
        # The real consumer, with the key, reads and releases: the transfer completes as usual.
        consumer.scheduler.on_alloc(ReqId("c-a"), parse_params(kv), (8, 9, 10, 11), 13, clock())
        run_until(
            [producer, consumer], lambda: bool(producer.reported_sending and consumer.reported_recving), clock=clock
        )
        t = producer.worker.state.transfers[(producer.worker.source, TransferId("tx-auth"))]
        assert t.decision is not None and t.decision.cause == "completed" and not consumer.failed_recving
    finally:
        producer.close()
        consumer.close()


def test_the_key_comes_from_an_environment_variable_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_TEST_KEY", "s" * 24)
    config = from_extra_config({"control_key_env": "KVLEDGER_TEST_KEY"}, kv_role="kv_producer", engine_id="p")
    assert config.control_key == b"s" * 24 and "s" * 24 not in repr(config)
    key_file = tmp_path / "key"
    key_file.write_bytes(b"f" * 20 + b"\n")
    config = from_extra_config({"control_key_file": str(key_file)}, kv_role="kv_producer", engine_id="p")
    assert config.control_key == b"f" * 20
    assert from_extra_config({}, kv_role="kv_producer", engine_id="p").control_key is None
    monkeypatch.setenv("KVLEDGER_SHORT", "short")
    bad: list[dict[str, object]] = [
        {"control_key_env": "KVLEDGER_UNSET_FOR_SURE"},
        {"control_key_env": "KVLEDGER_SHORT"},
        {"control_key_file": str(tmp_path / "missing")},
        {"control_key_env": "KVLEDGER_TEST_KEY", "control_key_file": str(key_file)},
    ]
    for extra in bad:
        with pytest.raises(ConfigError, match="control_key"):
            from_extra_config(extra, kv_role="kv_producer", engine_id="p")


def test_without_a_key_the_channel_says_at_start_that_control_messages_are_unauthenticated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hs, notify = free_loopback_ports(2)
    with caplog.at_level(logging.WARNING, logger="kvledger.connector.channel"):
        channel = Channel("127.0.0.1", hs, notify, lambda host, port: True)
    channel.close()
    assert any("unauthenticated" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvledger.connector.channel"):
        channel = Channel("127.0.0.1", hs, notify, lambda host, port: True, key=KEY)
    channel.close()
    assert not any("unauthenticated" in r.getMessage() for r in caplog.records)


def test_a_flood_of_forged_messages_is_taken_a_bounded_number_per_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvledger.connector.worker as worker_module

    monkeypatch.setattr(worker_module, "POLL_DROPS_MAX", 2)
    p = free_loopback_ports(6)
    prod, cons = EnginePorts(p[0], p[1], p[2]), EnginePorts(p[3], p[4], p[5])
    producer = Side.build(make_config("producer", "read", prod, cons, control_key=KEY), fill=True, seed=1)
    try:
        for i in range(5):
            _raw_send(prod.notify, ReleaseBlocks(transfer_id=TransferId(f"tx-{i}"), rank=0, consumer_tp_size=1))
        assert _wait_for(lambda: producer.worker.channel.counters["dropped_bad_mac"] == 5)

        def drops() -> int:
            return sum(1 for e in producer.worker.ledger.log.since(0) if isinstance(e, Drop))

        counts = []
        for step in range(3):
            producer.worker.poll(1000.0 + step)
            counts.append(drops())
        assert counts == [2, 4, 5]
    finally:
        producer.close()
