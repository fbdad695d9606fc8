"""The connector's configuration from `kv_connector_extra_config`, validated at start.

Key names follow MoRIIO where the meaning is the same (`read_mode`,
`transfer_timeout`, `defer_timeout`, `recv_abort_timeout`, `handshake_port`,
`notify_port`, `backend`, `host_ip`); kvledger adds `ledger_url`, `source_name`,
`transport_port`, `peers`, `peer_tp_size`, `incident_log_dir` (each process appends
its events to a JSONL incident log there), `control_key_env` / `control_key_file`
(where the HMAC key of control messages is: an environment variable's name, or a
file; `control_key_next_env` / `control_key_next_file` a second key accepted during a rotation) and one test hook,
`test_hook_received_kv` (`module:function`, called with the blocks each completed receive loaded: the e2e
tests' negative control overwrites them with noise; never in production; see `hooks.py`).
A bad value raises `ConfigError` naming the key, so a typo stops the engine at start instead of in the first transfer.
"""

from __future__ import annotations

import functools
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvledger.connector import limits
from kvledger.connector.messages import RankAddress
from kvledger.connector.metadata import PeerRef
from kvledger.connector.ports import engine_ports, rank_port
from kvledger.ledger.events import Mode, Role
from kvledger.ledger.limits import DEFAULT_DEFER_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S

BACKENDS = ("tcp", "mori")
LEDGER_URL_SCHEMES = ("memory", "sqlite", "postgresql", "postgres", "postgresql+psycopg")

IGNORED_MORIIO_KEYS = frozenset(
    {"proxy_ip", "proxy_ping_port", "http_port", "qp_per_transfer", "post_batch_size", "num_workers"}
)
"""MoRIIO keys accepted so that one extra_config serves both connectors; they do nothing here."""


class ConfigError(ValueError):
    """A `kv_connector_extra_config` value that cannot be used; the message names the key."""


@dataclass(frozen=True)
class PeerEngine:
    """Another engine this one may dial: its host and base ports (ranks add their offset)."""

    host: str
    handshake_port: int
    notify_port: int
    transport_port: int
    tp_size: int = 1
    dp_size: int = 1

    def listens_on(self) -> set[tuple[str, int]]:
        """Every (host, port) this engine's ranks listen on."""
        ports: set[int] = set()
        for base in (self.handshake_port, self.notify_port, self.transport_port):
            ports.update(engine_ports(base, self.dp_size, self.tp_size))
        return {(self.host, port) for port in ports}


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the core needs; built by `from_extra_config` (or directly in tests)."""

    role: Role
    mode: Mode
    engine_id: str
    host: str = "127.0.0.1"
    handshake_port: int = limits.DEFAULT_HANDSHAKE_PORT
    notify_port: int = limits.DEFAULT_NOTIFY_PORT
    transport_port: int = limits.DEFAULT_TRANSPORT_PORT
    backend: str = "tcp"
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    defer_timeout_s: float = DEFAULT_DEFER_TIMEOUT_S
    recv_abort_timeout_s: float = limits.DEFAULT_RECV_ABORT_TIMEOUT_S
    kv_lease_duration_s: float = limits.DEFAULT_KV_LEASE_DURATION_S
    """NIXL's `kv_lease_duration`; 0: no leases (a producer holds for `defer_timeout`, then frees)."""
    kv_lease_max_s: float = limits.DEFAULT_KV_LEASE_MAX_S
    refuse_released_reads: bool = True
    """A producer's tcp transport serves a read only while the transfer's side is held (checked before and
    after the bytes are copied); a consumer reads only a side it could confirm (mori). False (the storm's
    negative control, and nothing else) serves any registered bytes, as before leases."""
    ledger_url: str | None = None
    source_name: str = ""
    peers: tuple[PeerEngine, ...] = ()
    peer_tp_size: int = 1
    incident_log_dir: str | None = None
    test_hook_received_kv: str | None = None
    """Test hook, `module:function` (`hooks.load_hook`): a consumer worker calls it with the blocks each
    completed receive loaded, so a test can show that the decode really used transferred KV (noise there
    must change its output)."""
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    control_key: bytes | None = field(default=None, repr=False, compare=False)
    """The shared HMAC key for control messages (from `control_key_env` or `control_key_file`); None: the
    control messages travel unauthenticated, and the connector says so at start."""
    control_key_next: bytes | None = field(default=None, repr=False, compare=False)
    """A second key accepted (never signed with) while a fleet rotates (`control_key_next_env` / `_file`):
    docs/security.md gives the three steps."""
    allowed: frozenset[tuple[str, int]] = field(default=frozenset(), compare=False)

    def __post_init__(self) -> None:
        # The allow-list is derived once: the only (host, port) pairs this engine ever dials.
        allowed: set[tuple[str, int]] = set()
        for peer in self.peers:
            allowed |= peer.listens_on()
        object.__setattr__(self, "allowed", frozenset(allowed))
        if self.kv_lease_duration_s < 0 or self.kv_lease_max_s <= 0:
            raise ConfigError("kv_lease_duration must be >= 0 (0: off) and kv_lease_max > 0")
        if not self.source_name:
            object.__setattr__(self, "source_name", self.engine_id)

    # -- derived names and ports -------------------------------------------

    def source(self, *, scheduler: bool) -> str:
        """The ledger source of this process: `prefill-0/sched`, `prefill-0/tp1`, `prefill-0/dp1tp0`."""
        if scheduler:
            return f"{self.source_name}/sched"
        rank = f"tp{self.tp_rank}" if self.dp_size == 1 else f"dp{self.dp_rank}tp{self.tp_rank}"
        return f"{self.source_name}/{rank}"

    @property
    def leases(self) -> bool:
        """Whether consumers renew producers' holds (and producers hold past defer_timeout while renewed)."""
        return self.kv_lease_duration_s > 0

    @property
    def lease_renew_interval_s(self) -> float:
        return self.kv_lease_duration_s / limits.LEASE_RENEWALS_PER_LEASE

    def producer_deadline(self, now: float, *, scheduler: bool) -> float:
        """A producer side's deadline mapped at `now`. The worker holds for defer_timeout and moves it with each
        lease renewal; with leases on, the scheduler half's deadline is the backstop (kv_lease_max, never
        sooner than defer_timeout): it is decided by its worker's report, or at the backstop if the worker
        died."""
        return now + self.producer_hold_s(scheduler=scheduler)

    def producer_hold_s(self, *, scheduler: bool) -> float:
        """How long after its map a producer side's deadline falls (`producer_deadline`): a constant of the
        config, so that a hook can take it once rather than per request."""
        if scheduler and self.leases:
            return max(self.defer_timeout_s, self.kv_lease_max_s)
        return self.defer_timeout_s

    @functools.cached_property
    def address(self) -> PeerRef:
        """This engine as its peers name it: in the params a producer hands its consumer (`remote_*`)."""
        return PeerRef(
            engine_id=self.engine_id,
            host=self.host,
            handshake_port=self.handshake_port,
            notify_port=self.notify_port,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
        )

    @functools.cached_property
    def rank_address(self) -> RankAddress:
        """This rank as the messages it sends name their sender: the engine's address and its TP rank."""
        return RankAddress.of(self.address, self.tp_rank)

    def my_port(self, base: int) -> int:
        return self.rank_address.port(base)

    def find_peer(self, host: str, handshake_port: int, notify_port: int) -> PeerEngine | None:
        """The configured peer with these base ports, or None (then it must not be dialed)."""
        for peer in self.peers:
            if (peer.host, peer.handshake_port, peer.notify_port) == (host, handshake_port, notify_port):
                return peer
        return None

    def may_dial(self, host: str, port: int) -> bool:
        return (host, port) in self.allowed

    def may_receive_from(self, host: str) -> bool:
        """Whether a control message from `host` (the socket's peer address) may be read: a configured peer's."""
        return any(peer.host == host for peer in self.peers)


# -- parsing ----------------------------------------------------------------


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _bool(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ConfigError(f"{_key(name)}: expected true or false, got {value!r}")


def _seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{_key(name)}: expected a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{_key(name)}: must be a positive number of seconds, got {value!r}")
    return seconds


def _lease_seconds(extra: Mapping[str, Any]) -> float:
    """`kv_lease_duration` (NIXL's name): seconds, or 0 for no leases."""
    if extra.get("kv_lease_duration") in (0, "0", 0.0):
        return 0.0
    return _seconds(extra, "kv_lease_duration", limits.DEFAULT_KV_LEASE_DURATION_S)


def _port(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{_key(name)}: expected a port number, got {value!r}")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{_key(name)}: expected a port number, got {value!r}") from None
    if not 0 < port <= limits.PORT_MAX:
        raise ConfigError(f"{_key(name)}: port {port} outside 1..{limits.PORT_MAX}")
    return port


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{_key(name)}: expected a positive integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{_key(name)}: expected a positive integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{_key(name)}: must be >= 1, got {value!r}")
    return number


def _host(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{_key(name)}: expected an IP address, got {value!r}")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        # Names are refused: the allow-list compares exact addresses, and DNS may change under us.
        raise ConfigError(f"{_key(name)}: expected an IP address (not a host name), got {value!r}") from None
    return value


def _directory(value: Any, name: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{_key(name)}: expected a directory path, got {value!r}")
    return value


def _hook_path(value: Any, name: str) -> str | None:
    """`package.module:function`, checked for its form here; imported by the adapter (`hooks.load_hook`)."""
    if value is None or value == "":
        return None
    module, sep, function = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not all(part.isidentifier() for part in (*module.split("."), function)):
        raise ConfigError(f"{_key(name)}: expected 'package.module:function', got {value!r}")
    return str(value)


def check_ledger_url(value: Any) -> str | None:
    """None (in-memory only), `memory://`, `sqlite:///path` or `postgresql://...`; else ConfigError."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{_key('ledger_url')}: expected a URL string, got {value!r}")
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in LEDGER_URL_SCHEMES:
        raise ConfigError(f"{_key('ledger_url')}: {value!r} is not sqlite:///path, postgresql://... or memory://")
    if scheme == "sqlite" and (not rest.startswith("/") or rest in ("/", "/:memory:")):
        raise ConfigError(f"{_key('ledger_url')}: {value!r} needs a file path, as in sqlite:///var/ledger.db")
    if scheme.startswith("postgres") and not rest:
        raise ConfigError(f"{_key('ledger_url')}: {value!r} names no server")
    return value


def _peers(value: Any) -> tuple[PeerEngine, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{_key('peers')}: expected a list of peer engines, got {value!r}")
    if len(value) > limits.PEERS_MAX:
        raise ConfigError(f"{_key('peers')}: {len(value)} peers, at most {limits.PEERS_MAX}")
    out = []
    for i, item in enumerate(value):
        where = f"peers[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{_key(where)}: expected an object with host and ports, got {item!r}")
        unknown = set(item) - {"host", "handshake_port", "notify_port", "transport_port", "tp_size", "dp_size"}
        if unknown:
            raise ConfigError(f"{_key(where)}: unknown keys {sorted(unknown)}")
        for required in ("host", "handshake_port", "notify_port"):
            if required not in item:
                raise ConfigError(f"{_key(where + '.' + required)}: missing")
        out.append(
            PeerEngine(
                host=_host(item["host"], where + ".host"),
                handshake_port=_port(item["handshake_port"], where + ".handshake_port"),
                notify_port=_port(item["notify_port"], where + ".notify_port"),
                transport_port=_port(
                    item.get("transport_port", limits.DEFAULT_TRANSPORT_PORT), where + ".transport_port"
                ),
                tp_size=_positive_int(item.get("tp_size", 1), where + ".tp_size"),
                dp_size=_positive_int(item.get("dp_size", 1), where + ".dp_size"),
            )
        )
    return tuple(out)


KNOWN_KEYS = frozenset(
    {
        "read_mode",
        "transfer_timeout",
        "defer_timeout",
        "recv_abort_timeout",
        "handshake_port",
        "notify_port",
        "transport_port",
        "backend",
        "host_ip",
        "ledger_url",
        "source_name",
        "peers",
        "peer_tp_size",
        "incident_log_dir",
        "test_hook_received_kv",
        "control_key_env",
        "control_key_file",
        "control_key_next_env",
        "control_key_next_file",
        "kv_lease_duration",
        "kv_lease_max",
    }
)


def key_bytes(raw: bytes) -> bytes:
    """The one rule for a control key's bytes, from either source: exactly as given, less one trailing line
    ending (`\\n` or `\\r\\n`: what `echo` and editors add). Nothing else is stripped, so a binary key keeps
    its whitespace bytes, and an environment variable and a file holding the same line give the same key."""
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    if raw.endswith(b"\n"):
        return raw[:-1]
    return raw


def _control_key(extra: Mapping[str, Any], prefix: str = "control_key") -> bytes | None:
    """The HMAC key named by `<prefix>_env` (an environment variable, read as bytes) or `<prefix>_file` (a
    file), under `key_bytes`'s rule; None if neither is named."""
    import os

    env_name, file_name = f"{prefix}_env", f"{prefix}_file"
    env, path = extra.get(env_name), extra.get(file_name)
    if env is not None and path is not None:
        raise ConfigError(f"{_key(env_name)} and {_key(file_name)}: name one, not both")
    if env is not None:
        if not isinstance(env, str) or not env or "=" in env or "\0" in env:
            raise ConfigError(f"{_key(env_name)}: expected an environment variable name, got {env!r}")
        # Bytes as the environment holds them: a value that is not UTF-8 is a key like any other (os.environ
        # would hand it back as surrogates, which str.encode refuses).
        raw = os.environb.get(os.fsencode(env))
        if not raw:
            raise ConfigError(f"{_key(env_name)}: the environment variable {env!r} is unset or empty")
        name = env_name
    elif path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{_key(file_name)}: expected a file path, got {path!r}")
        try:
            with open(path, "rb") as f:
                raw = f.read(limits.HMAC_KEY_BYTES_MAX + 1)
        except OSError as error:
            raise ConfigError(f"{_key(file_name)}: cannot read {path!r}: {error.strerror}") from None
        name = file_name
    else:
        return None
    key = key_bytes(raw)
    if len(key) < limits.HMAC_KEY_BYTES_MIN:
        raise ConfigError(f"{_key(name)}: the key has {len(key)} bytes, at least {limits.HMAC_KEY_BYTES_MIN} needed")
    if len(key) > limits.HMAC_KEY_BYTES_MAX:
        raise ConfigError(f"{_key(name)}: the key has more than {limits.HMAC_KEY_BYTES_MAX} bytes")
    return key


def _control_keys(extra: Mapping[str, Any]) -> tuple[bytes | None, bytes | None]:
    """(the key this engine signs with, the next key it also accepts) for a rotation without dropped traffic."""
    key, next_key = _control_key(extra), _control_key(extra, "control_key_next")
    if next_key is not None and key is None:
        raise ConfigError(
            f"{_key('control_key_next_env')} / {_key('control_key_next_file')}: a next key needs a current key "
            f"({_key('control_key_env')} or {_key('control_key_file')})"
        )
    return key, next_key


def from_extra_config(
    extra: Mapping[str, Any] | None,
    *,
    kv_role: str,
    engine_id: str,
    dp_rank: int = 0,
    dp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> ConnectorConfig:
    """Validate `kv_connector_extra_config` and the engine's place; raise ConfigError naming the key."""
    extra = dict(extra or {})
    control_key, control_key_next = _control_keys(extra)
    unknown = set(extra) - KNOWN_KEYS - IGNORED_MORIIO_KEYS
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
    roles: dict[str, Role] = {"kv_producer": "producer", "kv_consumer": "consumer"}
    if kv_role not in roles:
        # kv_both was a consumer in MoRIIO's scheduler but a producer in its worker; refuse it.
        raise ConfigError(f"kv_role: expected kv_producer or kv_consumer, got {kv_role!r}")
    backend = str(extra.get("backend", "tcp")).strip().lower()
    if backend not in BACKENDS:
        raise ConfigError(f"{_key('backend')}: expected one of {list(BACKENDS)}, got {extra.get('backend')!r}")
    source_name = extra.get("source_name", engine_id)
    if not isinstance(source_name, str) or not source_name or "/" in source_name:
        raise ConfigError(f"{_key('source_name')}: expected a non-empty name without '/', got {source_name!r}")
    if not 0 <= tp_rank < tp_size or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"rank (dp {dp_rank}, tp {tp_rank}) outside (dp_size {dp_size}, tp_size {tp_size})")
    config = ConnectorConfig(
        role=roles[kv_role],
        mode="read" if _bool(extra, "read_mode", False) else "write",
        engine_id=engine_id,
        host=_host(extra.get("host_ip", "127.0.0.1"), "host_ip"),
        handshake_port=_port(extra.get("handshake_port", limits.DEFAULT_HANDSHAKE_PORT), "handshake_port"),
        notify_port=_port(extra.get("notify_port", limits.DEFAULT_NOTIFY_PORT), "notify_port"),
        transport_port=_port(extra.get("transport_port", limits.DEFAULT_TRANSPORT_PORT), "transport_port"),
        backend=backend,
        transfer_timeout_s=_seconds(extra, "transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S),
        defer_timeout_s=_seconds(extra, "defer_timeout", DEFAULT_DEFER_TIMEOUT_S),
        recv_abort_timeout_s=_seconds(extra, "recv_abort_timeout", limits.DEFAULT_RECV_ABORT_TIMEOUT_S),
        kv_lease_duration_s=_lease_seconds(extra),
        kv_lease_max_s=_seconds(extra, "kv_lease_max", limits.DEFAULT_KV_LEASE_MAX_S),
        ledger_url=check_ledger_url(extra.get("ledger_url")),
        source_name=source_name,
        peers=_peers(extra.get("peers")),
        peer_tp_size=_positive_int(extra.get("peer_tp_size", 1), "peer_tp_size"),
        incident_log_dir=_directory(extra.get("incident_log_dir"), "incident_log_dir"),
        test_hook_received_kv=_hook_path(extra.get("test_hook_received_kv"), "test_hook_received_kv"),
        control_key=control_key,
        control_key_next=control_key_next,
        dp_rank=dp_rank,
        dp_size=dp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    for name in ("handshake_port", "notify_port", "transport_port"):
        base = getattr(config, name)
        try:
            rank_port(base, dp_size - 1, tp_size - 1, tp_size)
        except ValueError as error:
            raise ConfigError(f"{_key(name)}: {error}") from None
    return config
