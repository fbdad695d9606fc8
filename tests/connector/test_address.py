"""One address per engine: the config builds it, the params carry it, a message's sender names its rank."""

from __future__ import annotations

from kvledger.connector.config import from_extra_config
from kvledger.connector.messages import RankAddress
from kvledger.connector.params import consumer_params, parse_params
from kvledger.connector.ports import rank_port
from kvledger.ledger.events import TransferId


def test_the_address_a_producer_hands_out_is_the_peer_its_consumer_reads_back() -> None:
    config = from_extra_config(
        {"host_ip": "10.0.0.7", "handshake_port": 7000, "notify_port": 8000},
        kv_role="kv_producer",
        engine_id="prefill-3",
        dp_rank=1,
        dp_size=2,
        tp_size=4,
    )
    raw = consumer_params(TransferId("tx-1"), (4, 5), config.address, block_groups=(2,))
    params = parse_params(raw)
    assert params is not None and params.do_remote_prefill and not params.do_remote_decode
    assert params.remote_block_ids == (4, 5) and params.remote_block_groups == (2,)
    assert params.peer() == config.address
    assert (config.address.engine_id, config.address.tp_size, config.address.dp_rank) == ("prefill-3", 4, 1)


def test_a_rank_names_itself_as_its_engine_and_rank_and_listens_where_peers_dial() -> None:
    config = from_extra_config(
        {"host_ip": "10.0.0.7", "handshake_port": 7000, "notify_port": 8000},
        kv_role="kv_consumer",
        engine_id="decode-1",
        dp_rank=1,
        dp_size=2,
        tp_rank=2,
        tp_size=4,
    )
    me = config.rank_address
    assert me == RankAddress(
        engine_id="decode-1", host="10.0.0.7", handshake_port=7000, notify_port=8000, dp_rank=1, tp_rank=2, tp_size=4
    )
    assert me == RankAddress.of(config.address, 2)
    assert me.port(me.notify_port) == config.my_port(config.notify_port) == rank_port(8000, 1, 2, 4) == 8006
    assert me.port(me.handshake_port) == 7006
