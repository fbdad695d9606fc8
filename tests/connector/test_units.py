"""Unit tests of the connector's parts: config, ports, layout, messages and channel."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from kvledger.connector import messages
from kvledger.connector.channel import Channel, PeerNotAllowed
from kvledger.connector.config import ConfigError, from_extra_config
from kvledger.connector.layout import LayoutError, block_ops, block_plan, geometry_of
from kvledger.connector.limits import MESSAGE_BYTES_MAX
from kvledger.connector.messages import ReleaseBlocks
from kvledger.connector.params import ParamsError, parse_params
from kvledger.connector.ports import engine_ports, free_loopback_ports, holder_ranks, rank_port, releases_expected
from kvledger.ledger.events import TransferId

# -- config -----------------------------------------------------------------


def test_config_defaults_follow_moriio() -> None:
    config = from_extra_config({}, kv_role="kv_producer", engine_id="prefill-0")
    assert (config.mode, config.transfer_timeout_s, config.defer_timeout_s) == ("write", 30.0, 60.0)
    assert config.source(scheduler=True) == "prefill-0/sched" and config.source(scheduler=False) == "prefill-0/tp0"


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"transfer_timeout": "soon"}, "transfer_timeout"),
        ({"defer_timeout": -1}, "defer_timeout"),
        ({"notify_port": 70000}, "notify_port"),
        ({"backend": "rdma"}, "backend"),
        ({"read_mode": "maybe"}, "read_mode"),
        ({"ledger_url": "mysql://x"}, "ledger_url"),
        ({"ledger_url": "sqlite://"}, "ledger_url"),
        ({"peers": [{"host": "example.com", "handshake_port": 1, "notify_port": 2}]}, "peers[0].host"),
        ({"peers": [{"host": "127.0.0.1", "notify_port": 2}]}, "peers[0].handshake_port"),
        ({"transfer_timout": 3}, "unknown keys"),
    ],
)
def test_bad_config_names_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        from_extra_config(extra, kv_role="kv_consumer", engine_id="decode-0")


def test_kv_both_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        from_extra_config({}, kv_role="kv_both", engine_id="x")


def test_ledger_urls_accepted() -> None:
    for url in ("sqlite:///tmp/ledger.db", "postgresql://u@h/db", "memory://", None):
        assert from_extra_config({"ledger_url": url}, kv_role="kv_producer", engine_id="p").ledger_url == url


# -- ports ------------------------------------------------------------------


@pytest.mark.parametrize(("dp_size", "tp_size"), [(1, 1), (1, 4), (2, 2), (3, 4), (4, 1)])
def test_every_rank_has_its_own_port_and_dialers_agree(dp_size: int, tp_size: int) -> None:
    ports = engine_ports(9000, dp_size, tp_size)
    assert len(set(ports)) == dp_size * tp_size
    peer = from_extra_config(
        {
            "peers": [
                {
                    "host": "127.0.0.1",
                    "handshake_port": 9000,
                    "notify_port": 9500,
                    "tp_size": tp_size,
                    "dp_size": dp_size,
                }
            ]
        },
        kv_role="kv_consumer",
        engine_id="d",
    )
    for dp in range(dp_size):
        for tp in range(tp_size):
            listener = from_extra_config(
                {"notify_port": 9500},
                kv_role="kv_producer",
                engine_id="p",
                dp_rank=dp,
                dp_size=dp_size,
                tp_rank=tp,
                tp_size=tp_size,
            )
            port = listener.my_port(listener.notify_port)
            assert port == rank_port(9500, dp, tp, tp_size)
            assert peer.may_dial("127.0.0.1", port)
    assert not peer.may_dial("127.0.0.1", 9500 + dp_size * tp_size)
    assert not peer.may_dial("10.0.0.1", 9500)


def test_release_fan_in() -> None:
    assert holder_ranks(3, 4, 2) == [1] and releases_expected(4, 2) == 2
    assert holder_ranks(1, 2, 4) == [2, 3] and releases_expected(2, 4) == 1
    with pytest.raises(ValueError):
        holder_ranks(0, 3, 2)


# -- layout -----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(2, 16, 4, 2, 8), (16, 2, 4, 2, 8), (16, 4, 32)],
    ids=["separated", "interleaved", "index-only"],
)
def test_block_ops_move_exactly_the_blocks(shape: tuple[int, ...]) -> None:
    source = torch.randn(*shape)
    target = torch.zeros(*shape)
    g = geometry_of(source, num_blocks=16)
    ops = block_ops(g, g, [5, 6, 9], [1, 2, 3, 7])  # shorter local list: the remote tail
    src, dst = source.view(torch.uint8).reshape(-1), target.view(torch.uint8).reshape(-1)
    for lo, ro, size in ops:
        dst[lo : lo + size] = src[ro : ro + size]
    axis = g.block_axis
    for local, remote in [(5, 2), (6, 3), (9, 7)]:
        assert torch.equal(target.select(axis, local), source.select(axis, remote))
    assert target.select(axis, 0).abs().sum() == 0


def test_layout_merges_adjacent_runs_and_caches_per_geometry() -> None:
    g = geometry_of(torch.zeros(16, 4, 32), num_blocks=16)
    assert block_ops(g, g, [1, 2, 3], [4, 5, 6]) == [(1 * 512, 4 * 512, 3 * 512)]
    assert block_plan(g) is block_plan(geometry_of(torch.ones(16, 4, 32), num_blocks=16))


def test_layout_errors() -> None:
    g = geometry_of(torch.zeros(16, 4, 32), num_blocks=16)
    with pytest.raises(LayoutError, match="local blocks"):
        block_ops(g, g, [1, 2, 3], [1, 2])
    assert block_ops(g, g, [], [1, 2]) == []  # free-only
    other = geometry_of(torch.zeros(16, 4, 16), num_blocks=16)
    with pytest.raises(LayoutError, match="contents differ"):
        block_ops(g, other, [1], [1])
    with pytest.raises(LayoutError):
        block_ops(g, g, [16], [1])


def test_permuted_view_is_split_into_runs() -> None:
    base = torch.randn(16, 2, 4, 8)  # (blocks, heads, tokens, dim)
    view = base.permute(0, 2, 1, 3)  # (blocks, tokens, heads, dim): non-contiguous inside a block
    plan = block_plan(geometry_of(view, num_blocks=16))
    assert plan.run_bytes * len(plan.run_offsets) == 2 * 4 * 8 * 4


# -- messages and channel ---------------------------------------------------------


def test_messages_round_trip_and_rejects() -> None:
    message = ReleaseBlocks(transfer_id=TransferId("tx-1"), rank=0, consumer_tp_size=1)
    assert messages.decode(messages.encode(message)) == message
    assert isinstance(messages.decode(b"\xc1garbage"), messages.Rejected)
    assert messages.decode(b"x" * (MESSAGE_BYTES_MAX + 1)).reason == "oversized"  # type: ignore[union-attr]
    old = messages.encode(ReleaseBlocks(transfer_id=TransferId("t"), rank=0, consumer_tp_size=1, version=99))
    assert messages.decode(old).reason == "version"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "message",
    [
        ReleaseBlocks(transfer_id=TransferId("t" * 201), rank=0, consumer_tp_size=1),
        ReleaseBlocks(transfer_id=TransferId("t\x00"), rank=0, consumer_tp_size=1),
        ReleaseBlocks(transfer_id=TransferId("t"), rank=(1 << 64) - 1, consumer_tp_size=1),
        messages.WriteDone(transfer_id=TransferId(""), rank=0),
    ],
    ids=["transfer id wider than the ledger's column", "NUL", "rank past 64 signed bits", "empty transfer id"],
)
def test_a_peer_cannot_make_this_process_record_an_invalid_event(message: messages.Message) -> None:
    """Recorded, such a message's transfer id or rank would make an event the store refuses."""
    rejected = messages.decode(messages.encode(message))
    assert isinstance(rejected, messages.Rejected) and rejected.reason == "malformed"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"transfer_id": "t" * 201, "do_remote_decode": True}, "transfer_id"),
        ({"transfer_id": "t\x00", "do_remote_decode": True}, "transfer_id"),
        ({"transfer_id": "t", "do_remote_prefill": True, "remote_block_ids": [1, 1 << 64]}, "remote_block_ids"),
    ],
)
def test_transfer_params_that_would_make_an_invalid_event_are_refused(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ParamsError, match=f"kv_transfer_params.{field}"):
        parse_params(raw)


def _wait_for(predicate: object, rounds: int = 500) -> bool:
    for _ in range(rounds):
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_channel_drops_bad_messages_and_keeps_listening() -> None:
    hs, notify = free_loopback_ports(2)
    listener = Channel("127.0.0.1", hs, notify, lambda host, port: True)
    sender = Channel("127.0.0.1", 0, 0, lambda host, port: (host, port) == ("127.0.0.1", notify))
    context: zmq.Context[object] = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://127.0.0.1:{notify}")
        raw.send(b"not msgpack \xc1")
        raw.send(b"\x00" * (MESSAGE_BYTES_MAX + 10))
        raw.send_multipart([b"a", b"b"])
        good = ReleaseBlocks(transfer_id=TransferId("tx-9"), rank=0, consumer_tp_size=1)
        assert sender.send("127.0.0.1", notify, good)
        assert _wait_for(lambda: listener.counters["received"] == 1)
        # Delivered as sent, addressed to the listener (the receiver the MAC covers when a key is set).
        assert listener.drain() == [msgspec.structs.replace(good, receiver=f"127.0.0.1:{notify}")]
        # The raw socket's messages come on a connection of their own: the good one may arrive before them.
        assert _wait_for(
            lambda: listener.counters["dropped_malformed"] == 2 and listener.counters["dropped_oversized"] == 1
        ), listener.counters
        with pytest.raises(PeerNotAllowed):
            sender.send("127.0.0.1", hs, good)
        with pytest.raises(PeerNotAllowed):
            sender.send("10.1.2.3", notify, good)
    finally:
        raw.close(linger=0)
        context.term()
        sender.close()
        listener.close()


def test_handshake_times_out_without_metadata() -> None:
    hs, notify = free_loopback_ports(2)
    listener = Channel("127.0.0.1", hs, notify, lambda host, port: True)
    dialer = Channel("127.0.0.1", 0, 0, lambda host, port: True)
    try:
        sender = messages.RankAddress(engine_id="d", host="127.0.0.1", handshake_port=1, notify_port=2)
        assert dialer.handshake("127.0.0.1", hs, sender, timeout_s=0.3) is None
        assert listener.counters["dropped_unexpected"] == 1 or _wait_for(
            lambda: listener.counters["dropped_unexpected"] == 1
        )
    finally:
        dialer.close()
        listener.close()


def test_free_loopback_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    import socket

    from kvledger.connector.limits import FREE_PORT_MIN
    from kvledger.connector.ports import _ephemeral_low

    ports = free_loopback_ports(8)
    assert len(set(ports)) == 8
    assert all(FREE_PORT_MIN <= port < _ephemeral_low() for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
