"""The control key (issue 36, item 5): one rule for both sources (the bytes as given, less one trailing line
ending), a configuration error naming the setting for what cannot be a key, and a second key accepted at
once so that a fleet rotates its key under traffic without one message dropped as `bad_mac` (real ZMQ on
loopback; engines restarted on their own ports, as a rolling restart does)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvledger.connector.channel import Channel
from kvledger.connector.config import ConfigError, from_extra_config
from kvledger.connector.messages import ReleaseBlocks
from kvledger.connector.ports import free_loopback_ports
from kvledger.ledger.events import TransferId
from tests.connector.pd import wait_for

WAIT_S = 10.0
K1 = b"first-key-" * 4
K2 = b"second-key-" * 4


def _key(extra: dict[str, object]) -> bytes | None:
    return from_extra_config(extra, kv_role="kv_producer", engine_id="p").control_key


def test_an_env_key_and_a_file_key_holding_the_same_line_are_the_same_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = "s" * 24 + "\n"  # `export KEY="$(cat key)"` drops the newline; `KEY=$'...\n'` or a k8s secret keeps it
    monkeypatch.setenv("KVLEDGER_TEST_KEY", line)
    key_file = tmp_path / "key"
    key_file.write_bytes(line.encode())
    from_env, from_file = _key({"control_key_env": "KVLEDGER_TEST_KEY"}), _key({"control_key_file": str(key_file)})
    assert from_env == from_file == b"s" * 24
    key_file.write_bytes(b"s" * 24 + b"\r\n")
    assert _key({"control_key_file": str(key_file)}) == b"s" * 24


def test_a_binary_key_file_keeps_its_whitespace_bytes(tmp_path: Path) -> None:
    key = b" \t" + bytes(range(256)) + b"\x0b\x0c "
    key_file = tmp_path / "key.bin"
    key_file.write_bytes(key)
    assert _key({"control_key_file": str(key_file)}) == key


def test_a_non_utf8_environment_key_is_a_key_not_a_unicode_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_TEST_KEY", "\udcff" * 20)  # the bytes 0xff, as os.environ shows them
    assert _key({"control_key_env": "KVLEDGER_TEST_KEY"}) == b"\xff" * 20


def test_what_cannot_be_a_key_is_a_config_error_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLEDGER_NEWLINE_ONLY", "\n")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 10_000)
    key_file = tmp_path / "key"
    key_file.write_bytes(K1)
    cases: list[tuple[dict[str, object], str]] = [
        ({"control_key_env": "KVLEDGER_NEWLINE_ONLY"}, "control_key_env"),
        ({"control_key_env": "A=B"}, "control_key_env"),
        ({"control_key_file": str(big)}, "control_key_file"),
        ({"control_key_next_file": str(key_file)}, "control_key_next"),
        (
            {"control_key_file": str(key_file), "control_key_next_env": "KVLEDGER_UNSET_FOR_SURE"},
            "control_key_next_env",
        ),
    ]
    for extra, setting in cases:
        with pytest.raises(ConfigError, match=setting):
            _key(extra)
    config = from_extra_config(
        {"control_key_file": str(key_file), "control_key_next_file": str(key_file)},
        kv_role="kv_producer",
        engine_id="p",
    )
    assert config.control_key == config.control_key_next == K1 and K1.decode() not in repr(config)


class _Engine:
    """One rank's channel, restarted on its own ports with new keys as a rolling restart does."""

    def __init__(self, key: bytes, next_key: bytes | None = None) -> None:
        self.hs, self.notify = free_loopback_ports(2)
        self.bad_mac = self.received = 0
        self.taken: set[str] = set()
        self.channel = self._open(key, next_key)

    def _open(self, key: bytes, next_key: bytes | None) -> Channel:
        return Channel("127.0.0.1", self.hs, self.notify, lambda h, p: True, key=key, next_key=next_key)

    def restart(self, key: bytes, next_key: bytes | None = None) -> None:
        self.collect()
        self.channel.close()
        self.channel = self._open(key, next_key)

    def collect(self) -> None:
        """What this incarnation took and refused so far (counted across restarts)."""
        self.taken |= {str(m.transfer_id) for m in self.channel.drain()}  # type: ignore[union-attr]
        self.bad_mac += self.channel.counters["dropped_bad_mac"]
        self.channel.counters["dropped_bad_mac"] = 0


def _rotate(steps: list[tuple[str, bytes, bytes | None]], burst: int) -> tuple[int, list[str]]:
    """Two engines send each other `burst` releases between every restart (and some are in flight at it);
    returns the bad MACs and the ids sent after a restart that never arrived."""
    engines = {"a": _Engine(K1), "b": _Engine(K1)}
    missing: list[str] = []
    n = 0

    def traffic() -> list[str]:
        nonlocal n
        ids = []
        for _ in range(burst):
            for name, other in (("a", "b"), ("b", "a")):
                n += 1
                tid = f"{name}-{n}"
                engines[name].channel.send("127.0.0.1", engines[other].notify, ReleaseBlocks(
                    transfer_id=TransferId(tid), rank=0, consumer_tp_size=1))  # fmt: skip
                ids.append(tid)
        return ids

    def reconnected() -> None:
        """Each engine has heard the other since the restart: a peer's connection to the old incarnation may
        take a moment to go (what it sends meanwhile can be lost, as on any restart: the ledger's timeouts
        cover it); the burst measured is sent once both ways carry messages again."""
        heard: set[str] = set()
        refused = sum(e.bad_mac for e in engines.values())
        for attempt in range(int(WAIT_S / 0.05)):
            for name, other in (("a", "b"), ("b", "a")):
                if name not in heard:
                    engines[name].channel.send("127.0.0.1", engines[other].notify, ReleaseBlocks(
                        transfer_id=TransferId(f"ping-{name}-{attempt}"), rank=0, consumer_tp_size=1))  # fmt: skip
            time.sleep(0.05)
            for engine in engines.values():
                engine.collect()
            taken = engines["a"].taken | engines["b"].taken
            heard |= {name for name in ("a", "b") if any(t.startswith(f"ping-{name}-") for t in taken)}
            if heard == {"a", "b"} or sum(e.bad_mac for e in engines.values()) > refused:
                return  # both ways carry messages (a refused one was carried too)

    try:
        for name, key, next_key in steps:
            traffic()  # in flight while `name` restarts: ZMQ redelivers it to the new incarnation
            engines[name].restart(key, next_key)
            reconnected()
            sent = traffic()

            def arrived(sent: list[str] = sent) -> bool:
                for engine in engines.values():
                    engine.collect()
                taken = engines["a"].taken | engines["b"].taken
                return all(tid in taken for tid in sent)

            wait_for(lambda: arrived() or (sum(e.bad_mac for e in engines.values()) > 0 and _settled()), WAIT_S)
            taken = engines["a"].taken | engines["b"].taken
            missing += [tid for tid in sent if tid not in taken]
        return sum(e.bad_mac for e in engines.values()), missing
    finally:
        for engine in engines.values():
            engine.channel.close()


def _settled() -> bool:
    time.sleep(0.2)  # with a bad MAC seen, give the rest of the burst a moment to land (or be refused)
    return True


def test_a_fleet_rotates_its_key_under_traffic_without_a_bad_mac() -> None:
    # Step 1: every engine accepts the next key; step 2: each signs with it, still accepting the old one;
    # step 3: the old one goes. Each engine restarts alone, its peer still on the previous step.
    rotation = [("a", K1, K2), ("b", K1, K2), ("a", K2, K1), ("b", K2, K1), ("a", K2, None), ("b", K2, None)]
    bad_mac, missing = _rotate(rotation, burst=50)
    assert bad_mac == 0 and missing == []


def test_a_key_swapped_without_the_next_key_drops_traffic_as_bad_mac() -> None:
    # The negative control: the same fleet swapping keys with one accepted at a time.
    bad_mac, missing = _rotate([("a", K2, None), ("b", K2, None)], burst=50)
    assert bad_mac > 0 and missing
