"""The daemon's configuration: one TOML file, read once, checked whole, frozen.

Rules:
- Where it comes from, first match wins (stated here once; docs/configuration.md and
  tests/test_config.py::test_precedence_* follow it): the ``path`` argument
  (``--config``), else ``$BUZZ_BROKER_CONFIG``, else `SYSTEM_CONFIG` when that file
  exists, else the built-in defaults (no file at all). An empty variable counts as unset.
  A file named by ``--config`` or the variable must exist; `SYSTEM_CONFIG` is optional.
  `Config.origin` says which of the four it was, so no command runs on a silent default.
- ``[relay] url`` has no default: a config without it loads (the admin commands never
  talk to the relay) with ``url = None``, and `serve`, `status` and `check-config` refuse it.
- The token PIN: ``$CREDENTIALS_DIRECTORY/token-pin`` (the systemd credential the unit
  hands over) when that file exists, else ``[pkcs11] pin_file``; `Pkcs11Config.pin_origin`
  names the source. The credential wins because it is what the unit provides; a
  ``pin_file`` pointing at the root-only original would only fail with EACCES.
- Every key lives in `_KEYS`, one row per key: section, key, parser, default. That table is
  the schema: a key not in it is an error naming the key, a section not in it is an error
  naming the section, and docs/configuration.md documents exactly its rows.
- When a key takes effect is its row's `reloaded`: SIGHUP applies [policy] (and [limits],
  whole); every other row is read once at start, and a reload that finds one changed names
  it (`restart_only_changes`) instead of applying it. docs/configuration.md marks exactly
  `RELOADED_SECTIONS` "(reloaded on SIGHUP)".
- Every number is bounded at both ends, by its row's parser (`_Integer`, `_Duration`), so
  `_KEYS` is also the table of ranges: a value that loads is one `serve` can run with.
  Uids and gids share one rule (`is_uid`).
- Every fault is one `ConfigError` line naming the file and the key (``[server]
  max_body_bytes``), never a traceback. Values are quoted back shortened: the file holds no
  secret (the PIN lives in the file `pin_file` names, never here).
- Relative paths in a file resolve against the directory of that file, so a config and
  its state directory can move together (``dir = "state"`` next to the config).
  `pkcs11.module` is the exception when it has no ``/`` at all: a bare library name is
  handed to the dynamic loader's search, as dlopen(3) does.
- The relay URL must be ``wss://``; ``ws://`` is allowed only to a loopback host (a local
  development relay), because the relay sees every signed event in clear otherwise.
- Durations are seconds (integer or float) or a string ``<number><s|m|h|d>``, more than
  0 and at most their row's maximum.

WARNING: `_KEYS`, the dataclasses below, docs/configuration.md and docs/internals.md
("daemon/config") must be kept in sync by hand; tests/test_config.py walks `_KEYS`.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from buzzwire.contract import ACTIONS, MAX_SCALAR_CHARS, scrub_line, trim
from buzzwire.loopback import LOOPBACK_NAMES, is_loopback_host
from custody import (DEFAULT_MAX_RECORDS, MAX_CACHE_ENTRIES, MAX_CACHE_SECONDS, MAX_KEK_LABEL,
                     MAX_UID, kek_label_ok)
from custody.custodian.messages import MAX_RECORDS
from daemon.loopback_tcp import ListenerKind, address_text
from daemon.relay.pool import (DEFAULT_LIVE_SUBSCRIPTIONS, DEFAULT_RECEIVE_BYTES,
                               DEFAULT_RESULT_BYTES, MAX_FRAME_BYTES, MAX_QUERY_BYTES)
from daemon.relay.windows import DEFAULT_WINDOW_BYTES
from daemon.relay.protocol import check_relay_url
from daemon.state.ratelimit import DEFAULT_RATE_CONFIG, RateConfig, rate_config_from_table

if TYPE_CHECKING:
    from custody import CachePolicy, RecordBound, TokenConfig

__all__ = [
    "load_config",
    "restart_only_changes",
    "Reread",
    "RELOADED_SECTIONS",
    "is_uid",
    "MAX_UID",
    "require_relay",
    "ConfigError",
    "Config",
    "ServerConfig",
    "StateConfig",
    "ObserverConfig",
    "CustodyConfig",
    "DEFAULT_OBSERVER",
    "Pkcs11Config",
    "RelayConfig",
    "PolicyConfig",
    "LogConfig",
    "MetricsConfig",
    "ENV_VAR",
    "SYSTEM_CONFIG",
    "PIN_CREDENTIAL",
    "ACTION_NAMES",
    "WORLD_BITS",
    "TCP_OPT_IN",
    "METRICS_OPT_IN",
    "ACTION_TCP",
    "METRICS_TCP",
]

#: The environment variable naming the config file when ``--config`` is absent.
ENV_VAR = "BUZZ_BROKER_CONFIG"

#: The file read when neither ``--config`` nor `ENV_VAR` names one, if it exists.
SYSTEM_CONFIG = "/etc/buzz-broker/broker.toml"

#: The systemd credential holding the token PIN (``LoadCredential=token-pin:...``).
PIN_CREDENTIAL = "token-pin"

#: The fifteen wire names (agent-broker.md §Operations and NIP-BA "Actions"), from the
#: contract's ActionSpec table.
ACTION_NAMES = frozenset(ACTIONS)

#: Log levels accepted by [log] level (daemon/log.py LEVELS, restated to keep this module
#: free of logging setup).
LOG_LEVELS = ("debug", "info", "warning", "error")


#: The keys by which the operator accepts the squatting risk of a port nobody holds for
#: the daemon (daemon/loopback_tcp.py): named here once, for `_KEYS` and for the reasons
#: `port_holder` gives.
TCP_OPT_IN = "listen_tcp_accept_squatting_risk"
METRICS_OPT_IN = "listen_accept_squatting_risk"
#: The two keys the daemon serves loopback TCP for, each with its socket unit and its risk.
ACTION_TCP = ListenerKind("[server] listen_tcp", TCP_OPT_IN, "buzz-broker-tcp.socket",
                          "collect the credentials agents send")
METRICS_TCP = ListenerKind("[metrics] listen", METRICS_OPT_IN, "buzz-broker-metrics.socket",
                           "answer the scraper with what it likes")


class ConfigError(Exception):
    """A bad or missing configuration: one line for the operator, naming file and key."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    socket: str
    socket_mode: int
    socket_group: str | None
    max_connections: int
    max_connections_per_uid: int
    max_inflight_bytes: int
    max_body_bytes: int
    max_header_bytes: int
    request_timeout: float
    shutdown_grace: float
    #: Loopback (host, port) pairs of the action API's TCP listeners; () = none (the
    #: default: the Unix socket is the recommended path). daemon/loopback_tcp.py has the rules.
    listen_tcp: tuple[tuple[str, int], ...] = ()
    #: The operator's explicit yes to serving TCP on a port nobody holds for us (not one
    #: systemd passed, not a privileged one): any local user could bind it first.
    listen_tcp_accept_squatting_risk: bool = False
    #: Who may connect over TCP (peer uid from the kernel), checked before a byte is read.
    tcp_allow_uids: frozenset[int] = frozenset()
    tcp_allow_groups: frozenset[str] = frozenset()
    #: Over TCP only uid-bound credentials authenticate unless this is true.
    tcp_allow_credentials_without_uid: bool = False
    #: Open connections carrying one credential (socket and TCP alike).
    max_connections_per_credential: int = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class StateConfig:
    dir: str
    ledger_retention_seconds: int
    #: how long a read's verdict (its page) is kept for replay (docs/configuration.md)
    read_retention_seconds: int
    #: the cap on one agent's ledger records, in counted bytes (daemon/state/ledger.py)
    ledger_max_bytes_per_agent: int
    #: the cap on one credential's refusal records, kept apart from its agent's (issue 22)
    ledger_max_refusal_bytes_per_credential: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pkcs11Config:
    module: str
    token_label: str
    #: The resolved PIN file: the systemd credential when present, else [pkcs11] pin_file.
    pin_file: str | None
    kek_label: str
    #: Where `pin_file` came from: "systemd credential", "[pkcs11] pin_file" or "none".
    pin_origin: str = "none"
    #: "auto", "gcm" or "etm" (custody._token: the seal new blobs get).
    seal: str = "auto"
    #: The unsealed-key cache (custody._cache, loaded only when on): off at 0 entries.
    unsealed_cache_entries: int = 0
    unsealed_cache_seconds: float = 30.0

    def token(self) -> TokenConfig:
        """The token custody opens: the one mapping from [pkcs11] to `custody.TokenConfig`
        (the daemon and every command that opens the token use it)."""
        from custody import TokenConfig  # custody loads the PKCS#11 binding: only when used

        return TokenConfig(module=self.module, token_label=self.token_label,
                           pin_file=self.pin_file, kek_label=self.kek_label, seal=self.seal)

    def cache(self) -> CachePolicy:
        from custody import CachePolicy

        return CachePolicy(self.unsealed_cache_entries, self.unsealed_cache_seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayConfig:
    #: None when the file names no relay (there is no default relay).
    url: str | None
    connect_timeout: float
    ok_timeout: float
    eose_timeout: float
    idle_seconds: float
    #: Decoded bytes of relay events every query holds together (daemon/relay/pool.py).
    max_result_bytes: int
    #: Estimated bytes every read window holds together (daemon/relay/windows.py); 0: none.
    read_window_bytes: int = DEFAULT_WINDOW_BYTES
    #: Live subscriptions (read windows) one agent's relay connection holds at most.
    max_live_subscriptions: int = DEFAULT_LIVE_SUBSCRIPTIONS
    #: Bytes of relay frames every connection holds together while they arrive
    #: (daemon/relay/pool.py `_ReceiveSlots`).
    max_receive_bytes: int = DEFAULT_RECEIVE_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    disabled_actions: frozenset[str]
    max_agent_depth: int
    #: The choices agents.create / agents.update may name (NIP-BA: host-declared, an unknown
    #: one refused). Empty offers none; a request that names none is not affected.
    runtimes: frozenset[str]
    providers: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class LogConfig:
    level: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    #: Path of the Prometheus admin socket; None = metrics off.
    socket: str | None
    #: Loopback (host, port) for a TCP scrape listener; None = off. Every local user can read it.
    listen: tuple[str, int] | None = None
    #: The operator's explicit yes to binding `listen` on a port nobody holds for us (not a
    #: privileged one, not one systemd passed: buzz-broker-metrics.socket): any local user
    #: could bind it first. Applied at start, as [server] listen_tcp's (daemon/cli/serve.py).
    listen_accept_squatting_risk: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CustodyConfig:
    #: The custodian's socket (custody/custodian/, docs/custodian.md): the pipeline signs through
    #: it and never opens the token. None = custody in this process ([pkcs11]).
    custodian_socket: str | None = None
    #: Key records, removed agents' included, past which custody in this process refuses a
    #: mint or an import (agents.create, `agent create`/`import`). With a custodian its own
    #: file's [custodian] max_records rules instead: this is not read.
    max_records: int = DEFAULT_MAX_RECORDS

    def records(self) -> RecordBound:
        """The record bound custody opens with in this process: the one mapping from
        [custody] max_records to `custody.RecordBound`, its refusal naming the key."""
        from custody import RecordBound

        return RecordBound(self.max_records, remedy=IN_PROCESS_REMEDY)


#: What a refusal at [custody] max_records tells the operator to do.
IN_PROCESS_REMEDY = (f"raise [custody] max_records (at most {MAX_RECORDS:,}) or forget "
                     "removed agents' records: buzz-broker agent forget PUBKEY ... "
                     "(agent list --all lists them)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObserverConfig:
    """[observer]: the queue observer.emit hands its kind 24200 events to
    (daemon/pipeline/observer.py). Bytes are counted as the encoded events."""

    #: every credential's queued events together
    max_queued_bytes: int
    #: one credential's share: a flood from one agent stops at it
    max_queued_bytes_per_credential: int
    #: events handed to the relay per second at most, all credentials together
    publish_per_second: int
    #: events awaiting the relay's OK at once
    max_in_flight: int
    #: the largest signed event (its JSON) the relay takes: a frame whose event is larger
    #: is not counted
    max_event_bytes: int = 65_536
    #: one agent's events handed to the relay per minute at most, evenly spaced: they
    #: count against its own relay quotas, which its posts and live signals need too
    publish_per_minute_per_agent: int = 30


#: The [observer] defaults, as `_KEYS` spells them (kept equal by tests/test_config.py).
DEFAULT_OBSERVER = ObserverConfig(max_queued_bytes=32 * 1024 * 1024,
                                  max_queued_bytes_per_credential=2 * 1024 * 1024,
                                  publish_per_second=50, max_in_flight=8)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    server: ServerConfig
    state: StateConfig
    pkcs11: Pkcs11Config
    relay: RelayConfig
    policy: PolicyConfig
    log: LogConfig
    metrics: MetricsConfig
    #: [limits]: rate limits and quotas, a table of rules of its own (daemon/state/ratelimit.py).
    limits: RateConfig = DEFAULT_RATE_CONFIG
    #: [observer]: the observer.emit publication queue.
    observer: ObserverConfig = DEFAULT_OBSERVER
    #: [custody]: where the keys are used (in this process, or the custodian's).
    custody: CustodyConfig = CustodyConfig()
    #: The file this came from (absolute), or None for the built-in defaults.
    source: str | None = None
    #: How it was chosen: "--config", "$BUZZ_BROKER_CONFIG", "system file" or
    #: "built-in defaults" (the precedence in the module docstring).
    origin: str = "built-in defaults"


# --------------------------------------------------------------------------- value parsers
# A parser takes (raw TOML value, directory of the file or None) and returns the Python
# value, or raises _Bad(expectation) - the caller turns that into a ConfigError line.


class _Bad(Exception):
    """A value does not fit its key; `args[0]` says what was expected."""


_Parser = Callable[[object, Path | None], object]


# Every number a key takes is bounded at both ends, in its `_KEYS` row (`_Integer`,
# `_Duration`), so `_KEYS` is also the table of ranges: the loader checks each row's, and
# tests/test_config.py walks the same rows. A value that loads is one the daemon's
# arithmetic, SQLite and the OS take: `check-config` passing means `serve` can start (a
# socket_group of 10**20 once passed it and then stopped `serve` with OverflowError; a
# ledger_retention of 10**20 seconds failed every publishing request). The maxima are
# generous, past any real use; the ones several rows share are these constants.

#: Connection caps ([server] max_connections, max_connections_per_uid,
#: max_connections_per_credential): 2**20, Linux's default fs.nr_open (the ceiling of
#: RLIMIT_NOFILE), twice the hard limit systemd gives a service (524,288). Each connection
#: holds a descriptor, so a larger cap is not reached on such a host.
MAX_CONNECTIONS = 1 << 20

#: Byte budgets and caps ([server], [state], [relay], [observer]): 1 TiB, the custodian's
#: bound for its own (custody/custodian/config.py `_RANGES`): past any host's memory or disk.
MAX_BYTES = 1 << 40

#: Timeouts and waits ([server] request_timeout, shutdown_grace; [relay] connect_timeout,
#: ok_timeout, eose_timeout, idle_seconds): a day, 288 times the largest default
#: (idle_seconds, 300 s). A request, relay answer or drain not done in a day will not be.
MAX_WAIT_SECONDS = 86400

#: [state] ledger_retention and read_retention: ten years, far past any retry worth
#: answering (agents retry within minutes). A ledger record expires at now + STALE_FACTOR
#: (2) x the retention (daemon/state/ledger.py), an integer SQLite must store (at most
#: 2**63 - 1): ten years keeps that near 2046; 10**20 seconds overflowed it.
MAX_RETENTION_SECONDS = 3650 * 86400


@dataclass(frozen=True, slots=True)
class _Integer:
    """An integer in `low`..`high`, both included."""

    low: int
    high: int

    def __call__(self, value: object, _base: Path | None) -> object:
        # bool is an int subclass in Python; `true` is not a number in a config.
        if (isinstance(value, bool) or not isinstance(value, int)
                or not self.low <= value <= self.high):
            raise _Bad(f"an integer in {self.low}..{self.high}")
        return value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")


def _spelt(seconds: int) -> str:
    """``86400`` -> ``86400 seconds ("1d")``: the largest unit that divides it."""
    unit = next(u for u in reversed(_UNITS) if seconds % _UNITS[u] == 0)
    return f"{seconds} seconds" + ("" if unit == "s" else f' ("{seconds // _UNITS[unit]}{unit}")')


@dataclass(frozen=True, slots=True)
class _Duration:
    """Seconds as a number, or ``"<n><s|m|h|d>"``; more than 0 and at most `high` seconds.

    A float, or with `whole` an int: rounded down to whole seconds, at least 1 (the ledger's
    retentions, which it adds to the clock in SQLite integers).
    """

    high: int
    whole: bool = False

    def __call__(self, value: object, _base: Path | None) -> object:
        expectation = (f"a positive duration of at most {_spelt(self.high)}: seconds, or a "
                       'string like "10s", "5m", "7d"')
        number: int | float
        if isinstance(value, bool):
            raise _Bad(expectation)
        if isinstance(value, (int, float)):
            number = value
        elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
            number = float(m.group(1)) * _UNITS[m.group(2)]
        else:
            raise _Bad(expectation)
        # Compared before float(): an integer past a float's range would raise
        # OverflowError there. NaN fails the comparison, infinity the bound.
        if not 0 < number <= self.high:
            raise _Bad(expectation)
        seconds = float(number)
        return max(1, int(seconds)) if self.whole else seconds


def _text(value: object, _base: Path | None) -> object:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise _Bad("a non-empty string")
    return value


def _kek_label(value: object, base: Path | None) -> object:
    """A label a sealed blob can name (custody's rule): `keys init` would refuse another."""
    text = _text(value, base)
    if not isinstance(text, str) or not kek_label_ok(text):
        raise _Bad(f"1 to {MAX_KEK_LABEL} printable ASCII characters (every sealed key names it)")
    return text


def _path(value: object, base: Path | None) -> object:
    text = _text(value, base)
    assert isinstance(text, str)
    path = Path(text)
    if not path.is_absolute() and base is not None:
        path = base / path
    return os.path.normpath(path)


def _optional_path(value: object, base: Path | None) -> object:
    # "" switches the thing off (metrics socket) or defers to systemd (pin_file).
    if value == "":
        return None
    return _path(value, base)


#: sockaddr_un's sun_path: 108 bytes with its NUL (daemon/http.py `MAX_SOCKET_PATH_BYTES`).
MAX_SOCKET_PATH_BYTES = 107


def _socket_path(parse: _Parser) -> _Parser:
    """`parse`, then a path bind() and connect() take: `check-config` refuses what `serve`
    would."""
    def socket_path(value: object, base: Path | None) -> object:
        path = parse(value, base)
        if isinstance(path, str) and len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise _Bad(f"a socket path of at most {MAX_SOCKET_PATH_BYTES} bytes (sockaddr_un)")
        return path
    return socket_path


def _module_path(value: object, base: Path | None) -> object:
    text = _text(value, base)
    assert isinstance(text, str)
    return text if "/" not in text else _path(text, base)


def _mode(value: object, _base: Path | None) -> object:
    expectation = 'an octal file mode such as "0660" (string) or 0o660 (integer)'
    if isinstance(value, bool):
        raise _Bad(expectation)
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        mode = int(value, 8)
    elif isinstance(value, int):
        mode = value
    else:
        raise _Bad(expectation)
    if not 0 <= mode <= 0o777:
        raise _Bad(expectation)
    return mode


#: Permission bits for "every other local user" (o+rwx). A socket with any of them lets
#: any process on the machine knock on the daemon without a credential (issue 13).
WORLD_BITS = 0o007


def _socket_mode(value: object, base: Path | None) -> object:
    mode = _mode(value, base)
    assert isinstance(mode, int)
    if mode & WORLD_BITS:
        raise _Bad(
            'a mode that grants other users nothing, such as "0660" or "0600" (a '
            "world-accessible socket lets every local user reach the daemon)"
        )
    return mode


def _group(value: object, _base: Path | None) -> object:
    """A group name, or a numeric gid (an integer, or a string of digits: daemon/http.py
    `_gid` and daemon/loopback_tcp.py `TcpAdmission` read those as gids, so both are ids)."""
    if value == "":
        return None
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value):
        value = int(value)
    elif isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?", value):
        return value
    # gid_t is uid_t's 32 bits with the same reserved -1 (chown(2): "leave unchanged"), so
    # one rule bounds both.
    if not is_uid(value):
        raise _Bad(f"a group name or numeric gid (0..{MAX_UID})")
    return str(value)


def _relay_url(value: object, base: Path | None) -> object:
    text = _text(value, base)
    assert isinstance(text, str)
    if text != text.strip():
        raise _Bad("a URL without surrounding spaces")
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise _Bad("a ws:// or wss:// URL") from None
    del port
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise _Bad("a wss:// URL (ws:// only to a loopback host)")
    if parts.username is not None or parts.password is not None:
        raise _Bad("a URL without user information")
    if parts.scheme == "ws" and not is_loopback_host(parts.hostname):
        raise _Bad("wss:// for a non-loopback relay (ws:// sends events unencrypted)")
    try:
        # The pool's own rule has the last word: what passes here must start.
        check_relay_url(text)
    except ValueError as exc:
        raise _Bad(f"a relay URL the daemon can use ({exc})") from None
    return text


def _loopback_listen(value: object, _base: Path | None) -> object:
    """``"127.0.0.1:9464"`` / ``"[::1]:9464"`` / ``"localhost:9464"``; "" = off.

    Loopback only: the port is readable by every local user already, and anything wider
    belongs behind a proxy the operator chooses.
    """
    expectation = 'a loopback "host:port" such as "127.0.0.1:9464" or "[::1]:9464" ("" = off)'
    if value == "":
        return None
    if not isinstance(value, str):
        raise _Bad(expectation)
    match = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]]+)):([0-9]{1,5})", value)
    if match is None:
        raise _Bad(expectation)
    host = match.group(1) or match.group(2)
    port = int(match.group(3))
    if host.lower() in LOOPBACK_NAMES:
        host = "127.0.0.1"  # a name could resolve elsewhere; bind the address it means
    # Only the literals a scrape's Host may name (daemon/loopback_tcp.py): 127.0.0.2 is
    # loopback too, but a listener there would refuse every request it got.
    if not 0 < port < 65536 or host.lower() not in TCP_HOSTS:
        raise _Bad(expectation)
    return host.lower(), port


#: The only hosts [server] listen_tcp binds: the literals a request's Host may name
#: (daemon/loopback_tcp.py), so the check of Host is exact.
TCP_HOSTS = ("127.0.0.1", "::1")


def _listen_tcp(value: object, _base: Path | None) -> object:
    """``["127.0.0.1:7475", "[::1]:7475"]``: loopback literals only; port 0 = a free one."""
    expectation = ('an array of "127.0.0.1:PORT" or "[::1]:PORT" (loopback only: every '
                   'other address is reachable from outside this machine)')
    if not isinstance(value, list):
        raise _Bad(expectation)
    pairs: list[tuple[str, int]] = []
    for item in value:
        match = re.fullmatch(r"(?:\[(::1)\]|(127\.0\.0\.1)):([0-9]{1,5})", item) if isinstance(
            item, str) else None
        if match is None or int(match.group(3)) > 65535:
            raise _Bad(f"{expectation}; {_shown(item)} is not")
        pair = (match.group(1) or match.group(2), int(match.group(3)))
        if pair not in pairs:
            pairs.append(pair)
    return tuple(pairs)


def _bool(value: object, _base: Path | None) -> object:
    if not isinstance(value, bool):
        raise _Bad("true or false")
    return value


def is_uid(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_UID


def _uid_set(value: object, _base: Path | None) -> object:
    if not isinstance(value, list) or not all(is_uid(u) for u in value):
        raise _Bad("an array of numeric uids")
    return frozenset(value)


def _group_set(value: object, base: Path | None) -> object:
    if not isinstance(value, list):
        raise _Bad("an array of group names or numeric gids")
    groups = set()
    for item in value:
        group = _group(item, base)
        if group is None:
            raise _Bad("an array of group names or numeric gids")
        groups.add(group)
    return frozenset(groups)


def _level(value: object, _base: Path | None) -> object:
    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise _Bad("one of " + ", ".join(LOG_LEVELS))
    return value.lower()


def _one_of(*allowed: str) -> _Parser:
    def parse(value: object, _base: Path | None) -> object:
        if not isinstance(value, str) or value not in allowed:
            raise _Bad("one of " + ", ".join(f'"{a}"' for a in allowed))
        return value

    return parse


def _string_set(allowed: frozenset[str]) -> _Parser:
    def parse(value: object, _base: Path | None) -> object:
        what = "an array of action names"
        if not isinstance(value, list):
            raise _Bad(what)
        items: set[str] = set()
        for item in value:
            if not isinstance(item, str) or not item.strip():
                raise _Bad(what)
            if item not in allowed:
                raise _Bad(f"{what}; {item!r} is not one of " + ", ".join(sorted(allowed)))
            items.add(item)
        return frozenset(items)

    return parse


#: Names one [policy] choice list (runtimes, providers, models) holds at most: far more than
#: a host runs, so a longer list is a generated file gone wrong, not a host's offer.
MAX_CHOICES = 1024


def _choices(value: object, _base: Path | None) -> object:
    """[policy] runtimes / providers / models: the names a request may choose, exactly.

    Each name must be one a request could carry, since the check is exact: the wire trims
    White_Space, bounds a scalar at MAX_SCALAR_CHARS and refuses a line's control characters
    (buzzwire/contract), so a name padded, longer or holding one would never match. That is
    an operator's mistake, named here rather than left as a choice silently never offered.
    """
    what = (f"an array of at most {MAX_CHOICES} names, each 1-{MAX_SCALAR_CHARS} characters "
            "with no surrounding whitespace or control characters")
    if not isinstance(value, list) or len(value) > MAX_CHOICES:
        raise _Bad(what)
    for item in value:
        if (not isinstance(item, str) or not item or trim(item) != item
                or len(item) > MAX_SCALAR_CHARS or scrub_line(item) != item):
            raise _Bad(f"{what}; {_shown(item)} is not")
    return frozenset(value)


# --------------------------------------------------------------------------- the schema


@dataclass(frozen=True, slots=True)
class _Key:
    section: str
    key: str
    field: str  # attribute of the section's dataclass
    parse: _Parser
    # A raw TOML value, parsed like a file's (so defaults are checked too); None: no default.
    default: object
    # True: SIGHUP applies a changed value (daemon/pipeline/broker.py `Broker.reload`).
    # False: read once at start; a reload that finds it changed says "restart to apply"
    # (`restart_only_changes`). A section's rows agree (docs/configuration.md marks whole
    # sections "(reloaded on SIGHUP)": tests/test_config.py holds the marks to these rows).
    reloaded: bool = False


_KEYS: tuple[_Key, ...] = (
    _Key("server", "socket", "socket", _socket_path(_path), "/run/buzz-broker/broker.sock"),
    _Key("server", "socket_mode", "socket_mode", _socket_mode, "0660"),
    _Key("server", "socket_group", "socket_group", _group, ""),
    _Key("server", "max_connections", "max_connections", _Integer(1, MAX_CONNECTIONS), 1024),
    _Key("server", "max_connections_per_uid", "max_connections_per_uid",
         _Integer(1, MAX_CONNECTIONS), 128),
    # 64 MiB: 128 requests of the largest size; each uid gets total / (uids holding + 1).
    _Key("server", "max_inflight_bytes", "max_inflight_bytes", _Integer(1024, MAX_BYTES),
         67108864),
    _Key("server", "max_body_bytes", "max_body_bytes", _Integer(1024, MAX_BYTES), 524288),
    # Below ~1 KiB a normal request line plus Authorization header no longer fits.
    _Key("server", "max_header_bytes", "max_header_bytes", _Integer(1024, MAX_BYTES), 16384),
    _Key("server", "request_timeout", "request_timeout", _Duration(MAX_WAIT_SECONDS), 10),
    _Key("server", "shutdown_grace", "shutdown_grace", _Duration(MAX_WAIT_SECONDS), 10),
    _Key("server", "listen_tcp", "listen_tcp", _listen_tcp, []),
    _Key("server", TCP_OPT_IN, TCP_OPT_IN, _bool, False),
    _Key("server", "tcp_allow_uids", "tcp_allow_uids", _uid_set, []),
    _Key("server", "tcp_allow_groups", "tcp_allow_groups", _group_set, []),
    _Key("server", "tcp_allow_credentials_without_uid", "tcp_allow_credentials_without_uid",
         _bool, False),
    _Key("server", "max_connections_per_credential", "max_connections_per_credential",
         _Integer(1, MAX_CONNECTIONS), 32),
    _Key("state", "dir", "dir", _path, "/var/lib/buzz-broker"),
    _Key("state", "ledger_retention", "ledger_retention_seconds",
         _Duration(MAX_RETENTION_SECONDS, whole=True), "7d"),
    _Key("state", "read_retention", "read_retention_seconds",
         _Duration(MAX_RETENTION_SECONDS, whole=True), "15m"),
    _Key("state", "ledger_max_bytes_per_agent", "ledger_max_bytes_per_agent",
         _Integer(4096, MAX_BYTES), 256 * 1024 * 1024),
    # 4 MiB: ~26,000 refusals at ~160 bytes each (docs/operations.md, "Disk").
    _Key("state", "ledger_max_refusal_bytes_per_credential",
         "ledger_max_refusal_bytes_per_credential", _Integer(4096, MAX_BYTES), 4 * 1024 * 1024),
    _Key("pkcs11", "module", "module", _module_path, "/usr/lib/softhsm/libsofthsm2.so"),
    _Key("pkcs11", "token_label", "token_label", _text, "buzz-broker"),
    # "": no file; the PIN comes from the systemd credential `PIN_CREDENTIAL` (the unit's
    # LoadCredential=). A default naming the root-only original would only fail with EACCES.
    _Key("pkcs11", "pin_file", "pin_file", _optional_path, ""),
    _Key("pkcs11", "kek_label", "kek_label", _kek_label, "buzz-broker-kek"),
    _Key("pkcs11", "seal", "seal", _one_of("auto", "gcm", "etm"), "auto"),
    # custody's CachePolicy's own bounds (custody/_records.py): 64 Ki keys, an hour.
    _Key("pkcs11", "unsealed_cache_entries", "unsealed_cache_entries",
         _Integer(0, MAX_CACHE_ENTRIES), 0),
    _Key("pkcs11", "unsealed_cache_seconds", "unsealed_cache_seconds",
         _Duration(int(MAX_CACHE_SECONDS)), 30),
        # No default: a placeholder relay would only fail later, far from the config file.
    _Key("relay", "url", "url", _relay_url, None),
    _Key("relay", "connect_timeout", "connect_timeout", _Duration(MAX_WAIT_SECONDS), 10),
    _Key("relay", "ok_timeout", "ok_timeout", _Duration(MAX_WAIT_SECONDS), 10),
    _Key("relay", "eose_timeout", "eose_timeout", _Duration(MAX_WAIT_SECONDS), 10),
    _Key("relay", "idle_seconds", "idle_seconds", _Duration(MAX_WAIT_SECONDS), 300),
    # At least one query at its own bound, or that query could never succeed.
    _Key("relay", "max_result_bytes", "max_result_bytes", _Integer(MAX_QUERY_BYTES, MAX_BYTES),
         DEFAULT_RESULT_BYTES),
    # Read windows (issue 24): 0 turns them off (every read goes to the relay).
    _Key("relay", "read_window_bytes", "read_window_bytes", _Integer(0, MAX_BYTES),
         DEFAULT_WINDOW_BYTES),
    # 0 keeps no live subscription at all (no windows either); 256 is far past any relay's cap.
    _Key("relay", "max_live_subscriptions", "max_live_subscriptions", _Integer(0, 256),
         DEFAULT_LIVE_SUBSCRIPTIONS),
    # At least one frame at its worst, or no connection could ever receive one.
    _Key("relay", "max_receive_bytes", "max_receive_bytes", _Integer(MAX_FRAME_BYTES, MAX_BYTES),
         DEFAULT_RECEIVE_BYTES),
    _Key("policy", "disabled_actions", "disabled_actions", _string_set(ACTION_NAMES), [],
         reloaded=True),
    _Key("policy", "max_agent_depth", "max_agent_depth", _Integer(0, 64), 3, reloaded=True),
    # The runtime names Buzz's clients use (shared/spec/buzz-on-the-relay.md). Providers and
    # models have no such shared vocabulary (free text "the host interprets"; Buzz's runtime
    # never sends them), and what one names is signed into the owner's public kind 30177
    # record: none is accepted until the operator declares the ones this host runs.
    _Key("policy", "runtimes", "runtimes", _choices,
         ["goose", "claude", "codex", "buzz-agent", "buzz-acp"], reloaded=True),
    _Key("policy", "providers", "providers", _choices, [], reloaded=True),
    _Key("policy", "models", "models", _choices, [], reloaded=True),
    _Key("log", "level", "level", _level, "info"),
    _Key("metrics", "socket", "socket", _socket_path(_optional_path), ""),
    _Key("metrics", "listen", "listen", _loopback_listen, ""),
    _Key("metrics", METRICS_OPT_IN, METRICS_OPT_IN, _bool, False),
    # [observer] (issue 23): 32 MiB holds ~360 of the largest events (a 64 KiB payload is
    # ~88 KiB once encrypted, base64'd and signed); a share of 2 MiB lets sixteen agents
    # flood at once before the total binds. 50 a second is all agents together (each agent's
    # own quotas are `publish_per_minute_per_agent`'s); 8 in flight hides one OK round trip.
    _Key("observer", "max_queued_bytes", "max_queued_bytes", _Integer(65536, MAX_BYTES),
         32 * 1024 * 1024),
    _Key("observer", "max_queued_bytes_per_credential", "max_queued_bytes_per_credential",
         _Integer(65536, MAX_BYTES), 2 * 1024 * 1024),
    _Key("observer", "publish_per_second", "publish_per_second", _Integer(1, 10000), 50),
    _Key("observer", "max_in_flight", "max_in_flight", _Integer(1, 256), 8),
    # What strfry and nostr-sdk's LocalRelay accept by default (measured on LocalRelay:
    # 65,536 bytes of event JSON, one more is refused); raise it for a relay that takes more.
    _Key("observer", "max_event_bytes", "max_event_bytes", _Integer(4096, MAX_BYTES), 65_536),
    # Buzz's relay counts every EVENT of a pubkey (kind 24200 included) against that
    # pubkey's quotas: 120 a minute for an agent (RateLimitConfig
    # agent_standard_messages_per_min) and 10 a second with its REQs (human_ws_events_per_sec,
    # as 50 in any 5 s). Past them it answers a NOTICE and no OK. 30 a minute, one every
    # 2 s, leaves 90 a minute and 9.5 a second of them to the agent's own posts, typing,
    # presence and reads; a relay without such quotas can take more.
    _Key("observer", "publish_per_minute_per_agent", "publish_per_minute_per_agent",
         _Integer(1, 600_000), 30),
    _Key("custody", "custodian_socket", "custodian_socket", _socket_path(_optional_path), ""),
    # The custodian's own range ([custodian] max_records): a keystore past MAX_RECORDS could
    # not be served by a custodian later, whose `agents` answer carries every record.
    _Key("custody", "max_records", "max_records", _Integer(1, MAX_RECORDS), DEFAULT_MAX_RECORDS),
)

#: The one section that is not rows of `_KEYS`: rate-limit rules (docs/operations.md).
#: SIGHUP applies it whole (`Broker.reload`: `RateLimiter.reconfigure`).
_LIMITS_SECTION = "limits"

#: The sections SIGHUP applies: those whose `_KEYS` rows are `reloaded`, and [limits].
#: Every other one is read once at start.
RELOADED_SECTIONS: frozenset[str] = frozenset(
    {row.section for row in _KEYS if row.reloaded} | {_LIMITS_SECTION})

_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "state": StateConfig,
    "pkcs11": Pkcs11Config,
    "relay": RelayConfig,
    "policy": PolicyConfig,
    "log": LogConfig,
    "metrics": MetricsConfig,
    "observer": ObserverConfig,
    "custody": CustodyConfig,
}


#: What may be a URL's user information (RFC 3986 §3.2.1): from after any scheme and `//`
#: to the value's LAST `@`, past any `/`, `?` or `#`: a password may hold those (base64
#: does), and a value refused as no URL at all may still hold one. Hiding too much of a
#: refused value costs a word of a message; too little, a password in the journal.
_USER_INFORMATION = re.compile(r"^(\s*(?:[A-Za-z][A-Za-z0-9+.-]*:)?(?://)?).*@", re.DOTALL)


def _shown(value: object) -> str:
    """`value` as a refusal quotes it: its repr, cut at 60 characters, with a URL's user
    information replaced. That is where a password goes (`wss://user:password@host`,
    refused in `[relay] url`), and the refusal goes to stderr: under systemd the journal,
    often readable more widely than the configuration (0640)."""
    if isinstance(value, str):
        value = _USER_INFORMATION.sub(r"\1<user information removed>@", value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pin(configured: object, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The PIN file and its origin: the systemd credential when it exists, else pin_file."""
    credentials = environ.get("CREDENTIALS_DIRECTORY", "")
    if credentials:
        candidate = os.path.join(credentials, PIN_CREDENTIAL)
        if os.path.lexists(candidate):
            return candidate, "systemd credential"
    if isinstance(configured, str):
        return configured, "[pkcs11] pin_file"
    return None, "none"


def _did_you_mean(name: str, names: list[str]) -> str:
    """The remedy for an unknown name: the nearest known one, else where they are all listed."""
    close = difflib.get_close_matches(name, names, n=1)
    return (f": did you mean {close[0]}?" if close
            else " (docs/configuration.md lists every section and key)")


def _build(tree: Mapping[str, object], where: str, base: Path | None, source: str | None,
           origin: str, environ: Mapping[str, str]) -> Config:
    known = {(k.section, k.key) for k in _KEYS}
    for section, body in tree.items():
        if section == _LIMITS_SECTION:
            continue  # its rows are rules, checked whole by rate_config_from_table below
        if section not in _SECTIONS:
            raise ConfigError(f"{where}: unknown section [{section}]"
                              f"{_did_you_mean(section, [*_SECTIONS, _LIMITS_SECTION])}")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        for key in body:
            if (section, key) not in known:
                keys = sorted(k for s, k in known if s == section)
                raise ConfigError(f"{where}: unknown key [{section}] {key}"
                                  f"{_did_you_mean(key, keys)}")
    fields: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
    for row in _KEYS:
        body = tree.get(row.section, {})
        assert isinstance(body, dict)
        present = row.key in body
        raw = body[row.key] if present else row.default
        if raw is None:  # a key without a default, absent: its commands refuse it
            fields[row.section][row.field] = None
            continue
        try:
            # Defaults are absolute already; only values from the file resolve against it.
            fields[row.section][row.field] = row.parse(raw, base if present else None)
        except _Bad as bad:
            raise ConfigError(
                f"{where}: [{row.section}] {row.key}: expected {bad.args[0]}, got {_shown(raw)}"
            ) from None
    limits_table = tree.get(_LIMITS_SECTION, {})
    if not isinstance(limits_table, dict):
        raise ConfigError(f"{where}: [{_LIMITS_SECTION}] must be a table")
    try:
        limits = rate_config_from_table(limits_table)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    pin_file, pin_origin = _pin(fields["pkcs11"]["pin_file"], environ)
    fields["pkcs11"].update(pin_file=pin_file, pin_origin=pin_origin)
    server = fields["server"]
    inflight, body = server["max_inflight_bytes"], server["max_body_bytes"]
    assert isinstance(inflight, int) and isinstance(body, int)  # both parsed as sizes above
    if inflight < body:
        raise ConfigError(
            f"{where}: [server] max_inflight_bytes: expected at least max_body_bytes "
            f"({server['max_body_bytes']}), got {server['max_inflight_bytes']}"
        )
    observer = fields["observer"]
    total, share = observer["max_queued_bytes"], observer["max_queued_bytes_per_credential"]
    assert isinstance(total, int) and isinstance(share, int)
    if share > total:
        raise ConfigError(
            f"{where}: [observer] max_queued_bytes_per_credential: expected at most "
            f"max_queued_bytes ({total}), got {share}"
        )
    if server["listen_tcp"] and not (server["tcp_allow_uids"] or server["tcp_allow_groups"]):
        # Every local user can reach a loopback port: with nobody allowed it would refuse all.
        raise ConfigError(
            f"{where}: [server] listen_tcp: expected tcp_allow_uids or tcp_allow_groups to "
            "name who may connect over TCP (every local user can reach a loopback port)"
        )
    sections = {name: cls(**fields[name]) for name, cls in _SECTIONS.items()}
    listen, listen_tcp = sections["metrics"].listen, sections["server"].listen_tcp
    if listen is not None and listen in listen_tcp:
        # One port cannot be both: a socket systemd passed could serve only one of them.
        raise ConfigError(
            f"{where}: [metrics] listen: {address_text(*listen)} is in [server] listen_tcp "
            "too; the metrics need a port of their own")
    return Config(**sections, limits=limits, source=source, origin=origin)


def load_config(path: str | None, environ: Mapping[str, str] = os.environ,
                *, system_file: str | None = None, path_origin: str = "--config") -> Config:
    """Read and check the configuration (precedence: the module docstring).

    Args:
        path: the ``--config`` value, or None.
        environ: where ``$BUZZ_BROKER_CONFIG`` and ``$CREDENTIALS_DIRECTORY`` are looked up
            (injectable for tests).
        system_file: the optional system-wide file; `SYSTEM_CONFIG` unless given (tests).
        path_origin: how `path` was given, for `Config.origin` (``check-config PATH``).

    Returns:
        The frozen `Config`; built-in defaults when no file is named and `system_file`
        does not exist.

    Raises:
        ConfigError: one line naming the file (and key) for a missing or unreadable file,
            bad TOML, an unknown section or key, or a bad value.
    """
    if path == "":  # `--config "$UNSET"`: never fall through to another file
        raise ConfigError("--config is empty: give the file's path, or leave --config out")
    if path:
        chosen, origin = path, path_origin
    elif environ.get(ENV_VAR):
        chosen, origin = environ[ENV_VAR], f"${ENV_VAR}"
    elif os.path.lexists(system := system_file or SYSTEM_CONFIG):
        chosen, origin = system, "system file"
    else:
        return _build({}, "built-in defaults", None, None, "built-in defaults", environ)
    file = Path(chosen).absolute()
    where = f"config {file}"
    # O_NONBLOCK: a FIFO named here cannot hang the open, and only a regular file is read
    # (checked on the open descriptor), as the PIN file and backup readers do.
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"{where}: permission denied") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{where}: is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{where}: not a regular file (a FIFO, socket or device); "
                              "name the configuration file itself")
        with open(fd, "rb", closefd=False) as handle:
            data = handle.read()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    try:
        tree = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from None
    # What tomllib lets escape as other exceptions: an integer past Python's digit limit
    # for int() (a plain ValueError; its text names a Python setting, not the file's
    # fault), and arrays or inline tables nested past the recursion limit.
    except ValueError:
        raise ConfigError(f"{where}: invalid TOML: a value too large to read (an integer "
                          "of thousands of digits)") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid TOML: arrays or tables nested too deeply") from None
    return _build(tree, where, file.parent, str(file), origin, environ)


def restart_only_changes(running: Config, reread: Config) -> tuple[str, ...]:
    """The settings a reload found changed that only a restart applies, as ``[relay] url``.

    Args:
        running: the configuration the daemon started with (what it still runs on for
            every row that is not `reloaded`).
        reread: the file as SIGHUP read it again.

    Returns:
        The names of the rows not `reloaded` whose values differ, in `_KEYS` order; () when
        a reload applies everything that changed. Names only: a value is never returned.
    """
    return tuple(
        f"[{row.section}] {row.key}" for row in _KEYS
        if not row.reloaded and (getattr(getattr(running, row.section), row.field)
                                 != getattr(getattr(reread, row.section), row.field)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Reread:
    """What a reload (SIGHUP) made of the configuration file, for `serve` to report.

    `rejected`: the file no longer loads: its `ConfigError` line, and nothing of the file
    was applied. Else `waiting`: the changed settings only a restart applies
    (`restart_only_changes`), read and not applied; () when everything changed was applied.
    """

    rejected: str | None = None
    waiting: tuple[str, ...] = ()


def require_relay(config: Config) -> str:
    """The relay URL, or a ConfigError naming the file: there is no default relay."""
    if config.relay.url is None:
        if config.source is None:  # no file was found at all: say where one was looked for
            raise ConfigError(
                f"no configuration file (no --config, ${ENV_VAR} unset or empty, no "
                f"{SYSTEM_CONFIG}), so [relay] url is not set and there is no default relay: "
                f'write {SYSTEM_CONFIG} with [relay] url = "wss://relay.example.org" '
                "(docs/install.md step 4), or name a file with --config")
        raise ConfigError(f"config {config.source}: [relay] url is not set (there is no "
                          'default relay; name yours, e.g. url = "wss://relay.example.org")')
    return config.relay.url
