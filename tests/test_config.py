"""daemon/config and `check-config`: the schema table, every key, every kind of fault."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from pathlib import Path
from typing import get_type_hints

import pytest

from daemon.cli import main
from daemon.cli import check_config
import daemon.config
from daemon.config import (
    _KEYS,
    _SECTIONS,
    _Duration,
    _Integer,
    _Key,
    ACTION_NAMES,
    ENV_VAR,
    MAX_RETENTION_SECONDS,
    MAX_UID,
    PIN_CREDENTIAL,
    RELOADED_SECTIONS,
    Config,
    ConfigError,
    load_config,
    restart_only_changes,
)

#: A value for every key that differs from its default, and what it must load as.
EVERY_KEY = """
[server]
socket = "/srv/bb/agents.sock"
socket_mode = "0600"
socket_group = "buzz-agents"
max_connections = 7
max_connections_per_uid = 3
max_inflight_bytes = 8192
max_body_bytes = 4096
max_header_bytes = 2048
request_timeout = "1.5s"
shutdown_grace = 3
listen_tcp = ["127.0.0.1:7475", "[::1]:7475"]
listen_tcp_accept_squatting_risk = true
tcp_allow_uids = [1000, 1001]
tcp_allow_groups = ["buzz-agents"]
tcp_allow_credentials_without_uid = true
max_connections_per_credential = 4

[state]
dir = "/srv/bb/state"
ledger_retention = "2h"
read_retention = "5m"
ledger_max_bytes_per_agent = 1048576
ledger_max_refusal_bytes_per_credential = 65536

[pkcs11]
module = "/opt/hsm/libvendor.so"
token_label = "other-token"
pin_file = "/etc/bb/pin"
kek_label = "other-kek"
seal = "etm"
unsealed_cache_entries = 64
unsealed_cache_seconds = "2m"

[relay]
url = "ws://127.0.0.1:7777"
connect_timeout = 2
ok_timeout = 3.5
eose_timeout = "1m"
idle_seconds = 30
max_result_bytes = 33554432
read_window_bytes = 1048576
max_live_subscriptions = 4
max_receive_bytes = 8388608

[policy]
disabled_actions = ["agents.delete", "profile.set"]
max_agent_depth = 1
runtimes = ["goose"]
providers = ["anthropic", "openai"]
models = ["claude-sonnet-4", "gpt-5"]

[log]
level = "debug"

[metrics]
socket = "/run/bb/metrics.sock"
listen = "[::1]:9464"
listen_accept_squatting_risk = true

[observer]
max_queued_bytes = 1048576
max_queued_bytes_per_credential = 131072
publish_per_second = 5
max_in_flight = 2
max_event_bytes = 131072
publish_per_minute_per_agent = 12

[custody]
custodian_socket = "/run/bb/custodian.sock"
max_records = 7000
"""

EXPECTED: dict[tuple[str, str], object] = {
    ("server", "socket"): "/srv/bb/agents.sock",
    ("server", "socket_mode"): 0o600,
    ("server", "socket_group"): "buzz-agents",
    ("server", "max_connections"): 7,
    ("server", "max_connections_per_uid"): 3,
    ("server", "max_inflight_bytes"): 8192,
    ("server", "max_body_bytes"): 4096,
    ("server", "max_header_bytes"): 2048,
    ("server", "request_timeout"): 1.5,
    ("server", "shutdown_grace"): 3.0,
    ("server", "listen_tcp"): (("127.0.0.1", 7475), ("::1", 7475)),
    ("server", "listen_tcp_accept_squatting_risk"): True,
    ("server", "tcp_allow_uids"): frozenset({1000, 1001}),
    ("server", "tcp_allow_groups"): frozenset({"buzz-agents"}),
    ("server", "tcp_allow_credentials_without_uid"): True,
    ("server", "max_connections_per_credential"): 4,
    ("state", "dir"): "/srv/bb/state",
    ("state", "ledger_retention_seconds"): 7200,
    ("state", "read_retention_seconds"): 300,
    ("state", "ledger_max_bytes_per_agent"): 1048576,
    ("state", "ledger_max_refusal_bytes_per_credential"): 65536,
    ("pkcs11", "module"): "/opt/hsm/libvendor.so",
    ("pkcs11", "token_label"): "other-token",
    ("pkcs11", "pin_file"): "/etc/bb/pin",
    ("pkcs11", "kek_label"): "other-kek",
    ("pkcs11", "seal"): "etm",
    ("pkcs11", "unsealed_cache_entries"): 64,
    ("pkcs11", "unsealed_cache_seconds"): 120.0,
    ("relay", "url"): "ws://127.0.0.1:7777",
    ("relay", "connect_timeout"): 2.0,
    ("relay", "ok_timeout"): 3.5,
    ("relay", "eose_timeout"): 60.0,
    ("relay", "idle_seconds"): 30.0,
    ("relay", "max_result_bytes"): 33554432,
    ("relay", "read_window_bytes"): 1048576,
    ("relay", "max_live_subscriptions"): 4,
    ("relay", "max_receive_bytes"): 8388608,
    ("policy", "disabled_actions"): frozenset({"agents.delete", "profile.set"}),
    ("policy", "max_agent_depth"): 1,
    ("policy", "runtimes"): frozenset({"goose"}),
    ("policy", "providers"): frozenset({"anthropic", "openai"}),
    ("policy", "models"): frozenset({"claude-sonnet-4", "gpt-5"}),
    ("log", "level"): "debug",
    ("metrics", "socket"): "/run/bb/metrics.sock",
    ("metrics", "listen"): ("::1", 9464),
    ("metrics", "listen_accept_squatting_risk"): True,
    ("observer", "max_queued_bytes"): 1_048_576,
    ("observer", "max_queued_bytes_per_credential"): 131_072,
    ("observer", "publish_per_second"): 5,
    ("observer", "max_in_flight"): 2,
    ("observer", "max_event_bytes"): 131_072,
    ("observer", "publish_per_minute_per_agent"): 12,
    ("custody", "custodian_socket"): "/run/bb/custodian.sock",
    ("custody", "max_records"): 7000,
}

DEFAULTS: dict[tuple[str, str], object] = {
    ("server", "socket"): "/run/buzz-broker/broker.sock",
    ("server", "socket_mode"): 0o660,
    ("server", "socket_group"): None,
    ("server", "max_connections"): 1024,
    ("server", "max_connections_per_uid"): 128,
    ("server", "max_inflight_bytes"): 64 * 1024 * 1024,
    ("server", "max_body_bytes"): 524288,
    ("server", "max_header_bytes"): 16384,
    ("server", "request_timeout"): 10.0,
    ("server", "shutdown_grace"): 10.0,
    ("server", "listen_tcp"): (),
    ("server", "listen_tcp_accept_squatting_risk"): False,
    ("server", "tcp_allow_uids"): frozenset(),
    ("server", "tcp_allow_groups"): frozenset(),
    ("server", "tcp_allow_credentials_without_uid"): False,
    ("server", "max_connections_per_credential"): 32,
    ("state", "dir"): "/var/lib/buzz-broker",
    ("state", "ledger_retention_seconds"): 7 * 86400,
    ("state", "read_retention_seconds"): 15 * 60,
    ("state", "ledger_max_bytes_per_agent"): 256 * 1024 * 1024,
    ("state", "ledger_max_refusal_bytes_per_credential"): 4 * 1024 * 1024,
    ("pkcs11", "module"): "/usr/lib/softhsm/libsofthsm2.so",
    ("pkcs11", "token_label"): "buzz-broker",
    ("pkcs11", "pin_file"): None,  # the systemd credential, when there is one
    ("pkcs11", "kek_label"): "buzz-broker-kek",
    ("pkcs11", "seal"): "auto",
    ("pkcs11", "unsealed_cache_entries"): 0,
    ("pkcs11", "unsealed_cache_seconds"): 30.0,
    ("relay", "url"): None,  # no placeholder relay
    ("relay", "connect_timeout"): 10.0,
    ("relay", "ok_timeout"): 10.0,
    ("relay", "eose_timeout"): 10.0,
    ("relay", "idle_seconds"): 300.0,
    ("relay", "max_result_bytes"): 67108864,
    ("relay", "read_window_bytes"): 67108864,
    ("relay", "max_live_subscriptions"): 8,
    ("relay", "max_receive_bytes"): 33554432,
    ("policy", "disabled_actions"): frozenset(),
    ("policy", "max_agent_depth"): 3,
    ("policy", "runtimes"): frozenset({"goose", "claude", "codex", "buzz-agent", "buzz-acp"}),
    # NIP-BA: unknown choices are refused; no shared provider/model vocabulary exists, so
    # none is offered until the operator declares them.
    ("policy", "providers"): frozenset(),
    ("policy", "models"): frozenset(),
    ("log", "level"): "info",
    ("metrics", "socket"): None,
    ("metrics", "listen"): None,
    ("metrics", "listen_accept_squatting_risk"): False,
    ("observer", "max_queued_bytes"): 32 * 1024 * 1024,
    ("observer", "max_queued_bytes_per_credential"): 2 * 1024 * 1024,
    ("observer", "publish_per_second"): 50,
    ("observer", "max_in_flight"): 8,
    ("observer", "max_event_bytes"): 65_536,
    ("observer", "publish_per_minute_per_agent"): 30,
    ("custody", "custodian_socket"): None,
    ("custody", "max_records"): 5000,
}


def value(config: Config, section: str, field: str) -> object:
    return getattr(getattr(config, section), field)


def write(tmp_path: Path, text: str, name: str = "broker.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_tables_cover_every_key() -> None:
    fields = {(k.section, k.field) for k in _KEYS}
    assert fields == set(DEFAULTS) == set(EXPECTED)


@pytest.fixture(autouse=True)
def no_system_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own /etc/buzz-broker/broker.toml (absent unless the test writes it)."""
    path = tmp_path / "etc-broker.toml"
    monkeypatch.setattr(daemon.config, "SYSTEM_CONFIG", str(path))
    return path


def test_defaults_without_a_file() -> None:
    config = load_config(None, environ={})
    assert config.source is None and config.origin == "built-in defaults"
    for (section, field), expected in DEFAULTS.items():
        assert value(config, section, field) == expected, (section, field)


def test_every_key_parsed(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, EVERY_KEY), environ={})
    for (section, field), expected in EXPECTED.items():
        assert value(config, section, field) == expected, (section, field)


def test_documentation_lists_every_key() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    for row in _KEYS:
        assert f"`{row.key}`" in doc and f"[{row.section}]" in doc, row


#: A section heading of docs/configuration.md: ``## `[policy]` — host policy (reloaded on SIGHUP)``.
SECTION_HEADING = re.compile(r"^## `\[([a-z0-9_]+)\]`(.*)$", re.MULTILINE)


def test_documentation_marks_exactly_the_sections_sighup_applies() -> None:
    """docs/configuration.md's "(reloaded on SIGHUP)" marks are the schema's `reloaded`
    rows (and [limits]): one fact, one table, and the page follows it. A section's rows
    agree, since the page marks whole sections."""
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    headings = dict(SECTION_HEADING.findall(doc))
    assert set(headings) == set(_SECTIONS) | {"limits"}
    marked = {name for name, rest in headings.items() if "(reloaded on SIGHUP)" in rest}
    assert marked == RELOADED_SECTIONS == {"policy", "limits"}
    for section in _SECTIONS:
        assert {row.reloaded for row in _KEYS if row.section == section} in ({True}, {False})


def test_a_reload_names_the_changes_only_a_restart_applies(tmp_path: Path) -> None:
    """`restart_only_changes`: every row not `reloaded` whose value a reload found changed,
    by name (never its value); the sections SIGHUP applies are not named."""
    running = load_config(write(tmp_path, EVERY_KEY), environ={})
    assert restart_only_changes(running, running) == ()
    edits = {'url = "ws://127.0.0.1:7777"': 'url = "ws://127.0.0.1:7778"',
             'level = "debug"': 'level = "warning"',
             "max_agent_depth = 1": "max_agent_depth = 2"}
    edited = EVERY_KEY
    for old, new in edits.items():
        assert edited.count(old) == 1, old
        edited = edited.replace(old, new)
    reread = load_config(write(tmp_path, edited + '[limits]\npublish = "1/h"\n', "edited.toml"),
                         environ={})
    assert reread.policy.max_agent_depth == 2 and reread.limits != running.limits
    assert restart_only_changes(running, reread) == ("[relay] url", "[log] level")
    # Every row not reloaded is compared: EVERY_KEY differs from the defaults in each one.
    defaults = load_config(None, environ={})
    assert set(restart_only_changes(running, defaults)) == {
        f"[{row.section}] {row.key}" for row in _KEYS if not row.reloaded}


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    text = """
[server]
socket = "run/b.sock"
[state]
dir = "state"
[pkcs11]
module = "lib/libsofthsm2.so"
pin_file = "../pin"
[metrics]
socket = "m.sock"
"""
    config = load_config(write(tmp_path, text), environ={})
    assert config.server.socket == str(tmp_path / "run" / "b.sock")
    assert config.state.dir == str(tmp_path / "state")
    assert config.pkcs11.module == str(tmp_path / "lib" / "libsofthsm2.so")
    assert config.pkcs11.pin_file == str(tmp_path.parent / "pin")
    assert config.metrics.socket == str(tmp_path / "m.sock")


def test_bare_module_name_left_to_the_loader(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[pkcs11]\nmodule = "libsofthsm2.so"\n'), environ={})
    assert config.pkcs11.module == "libsofthsm2.so"


def test_empty_strings_switch_off(tmp_path: Path) -> None:
    text = '[pkcs11]\npin_file = ""\n[server]\nsocket_group = ""\n[metrics]\nsocket = ""\n'
    config = load_config(write(tmp_path, text), environ={})
    assert config.pkcs11.pin_file is None
    assert config.server.socket_group is None
    assert config.metrics.socket is None


def test_unknown_key_named(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nsocket = "/x.sock"\nsokcet_mode = "0600"\n')
    with pytest.raises(ConfigError, match=r"unknown key \[server\] sokcet_mode") as info:
        load_config(path, environ={})
    assert path in str(info.value)


def test_unknown_section_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown section \[tokens\]"):
        load_config(write(tmp_path, "[tokens]\nx = 1\n"), environ={})


def test_section_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[server\] must be a table"):
        load_config(write(tmp_path, 'server = "x"\n'), environ={})


@pytest.mark.parametrize("row", _KEYS, ids=lambda r: f"{r.section}.{r.key}")
def test_wrong_type_names_key_and_file(tmp_path: Path, row: object) -> None:
    section, key = row.section, row.key  # type: ignore[attr-defined]
    path = write(tmp_path, f"[{section}]\n{key} = {{ nested = 1 }}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert f"[{section}] {key}" in message and path in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("section", "key", "bad"),
    [
        ("server", "socket_mode", '"0999"'),
        ("server", "socket_mode", "true"),
        ("server", "socket_mode", "0o7777"),
        ("server", "socket_group", '"bad group"'),
        ("server", "max_connections", "0"),
        ("server", "max_connections", "1.5"),
        ("server", "max_connections", "true"),
        ("server", "max_body_bytes", "10"),
        ("server", "max_header_bytes", "-1"),
        ("server", "request_timeout", "0"),
        ("server", "request_timeout", "-3"),
        ("server", "request_timeout", '"10x"'),
        ("server", "request_timeout", "inf"),
        ("server", "request_timeout", "nan"),
        ("server", "socket", '""'),
        ("state", "ledger_retention", '"7 days"'),
        ("state", "ledger_max_bytes_per_agent", "100"),
        ("pkcs11", "token_label", '"  "'),
        ("relay", "url", '"http://relay.example.com"'),
        ("relay", "url", '"wss://"'),
        ("relay", "url", '"wss://user:pw@relay.example.com"'),
        ("relay", "url", '"wss://relay.example.com:99999"'),
        ("relay", "max_receive_bytes", "4194303"),  # one frame at its worst must fit
        ("policy", "disabled_actions", '["sign"]'),
        ("policy", "disabled_actions", '"message.post"'),
        ("policy", "runtimes", '["goose", ""]'),
        # The choice lists: each name one a request could carry (trimmed, <= 300, one line),
        # an array, bounded; all three alike.
        *((("policy", key, bad) for key in ("runtimes", "providers", "models") for bad in (
            '"goose"', "[1]", "[true]", '[""]', '[" padded"]', '["tab\\t"]',
            '["bidi\\u202e"]', f'["{"x" * 301}"]', "[" + '"x", ' * 1025 + "]"))),
        ("policy", "max_agent_depth", "-1"),
        ("policy", "max_agent_depth", "65"),
        ("log", "level", '"loud"'),
        ("metrics", "listen", '"0.0.0.0:9464"'),
        ("metrics", "listen", '"10.0.0.1:9464"'),
        ("metrics", "listen", '"127.0.0.2:9464"'),  # loopback, but no Host it would accept
        ("metrics", "listen", '"127.0.0.1"'),
        ("metrics", "listen", '"127.0.0.1:0"'),
        ("metrics", "listen", '"[::1]:70000"'),
        ("metrics", "listen", '"localhost.evil.com:80"'),
        ("metrics", "listen", "9464"),
        # issue 24: the action API's TCP listeners are loopback literals only
        ("server", "listen_tcp", '["0.0.0.0:7475"]'),
        ("server", "listen_tcp", '["[::]:7475"]'),
        ("server", "listen_tcp", '["10.0.0.1:7475"]'),
        ("server", "listen_tcp", '["192.168.1.2:7475"]'),
        ("server", "listen_tcp", '["127.0.0.1:7475", "example.org:7475"]'),
        ("server", "listen_tcp", '["localhost:7475"]'),
        ("server", "listen_tcp", '["127.0.0.1:70000"]'),
        ("server", "listen_tcp", '"127.0.0.1:7475"'),
        ("server", "listen_tcp_accept_squatting_risk", '"yes"'),
        ("metrics", "listen_accept_squatting_risk", '"yes"'),
        ("server", "tcp_allow_uids", '["1000"]'),
        ("server", "tcp_allow_uids", "[-1]"),
        ("server", "tcp_allow_groups", '["bad group"]'),
        ("server", "max_connections_per_credential", "0"),
        # Gids are bounded as uids are (MAX_UID): past gid_t, check-config once passed it
        # and serve exited 70 (OverflowError in chown); (gid_t) -1, which chown(2) reads as
        # "leave unchanged", was accepted and silently ignored.
        ("server", "socket_group", "99999999999999999999"),
        ("server", "socket_group", '"99999999999999999999"'),
        ("server", "socket_group", "4294967295"),
        ("server", "socket_group", '"4294967295"'),
        ("server", "socket_group", "-1"),
        ("server", "socket_group", "true"),
        ("server", "tcp_allow_groups", "[4294967295]"),
        ("server", "tcp_allow_groups", '["99999999999999999999"]'),
        ("server", "tcp_allow_uids", "[4294967295]"),
    ],
)
def test_bad_values_named(tmp_path: Path, section: str, key: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[{section}\] {key}: expected"):
        load_config(write(tmp_path, f"[{section}]\n{key} = {bad}\n"), environ={})


# --------------------------------------------------------------------------- ranges

#: Every row whose value is a number, with its range: `_KEYS` is the table of ranges, read
#: by the loader and walked here.
RANGED = [row for row in _KEYS if isinstance(row.parse, (_Integer, _Duration))]
#: Numbers bounded by a rule of their own: a file mode is octal, 0..0o777 (`_mode`).
OTHER_NUMBERS = {("server", "socket_mode")}


def _row_id(row: _Key) -> str:
    return f"{row.section}.{row.key}"


def test_every_number_has_a_range() -> None:
    """A numeric field without a row in `RANGED` would take any value, up to one that
    breaks the daemon's arithmetic after check-config passed it."""
    numeric = {(row.section, row.key) for row in _KEYS
               if get_type_hints(_SECTIONS[row.section])[row.field] in (int, float)}
    assert numeric - OTHER_NUMBERS == {(row.section, row.key) for row in RANGED}


def _outside(row: _Key) -> list[str]:
    """TOML values just and far outside `row`'s range."""
    huge = "1" + "0" * 400  # past a float's range: float() of it raises OverflowError
    if isinstance(row.parse, _Integer):
        return [str(row.parse.low - 1), str(row.parse.high + 1), "99999999999999999999", huge]
    assert isinstance(row.parse, _Duration)
    return ["0", str(row.parse.high + 1), "1e300", '"99999999999999999999999999d"', huge]


@pytest.mark.parametrize(("row", "bad"), [(row, bad) for row in RANGED for bad in _outside(row)],
                         ids=lambda v: _row_id(v) if isinstance(v, _Key)
                         else v if len(v) <= 30 else f"{v[:3]}...{len(v)}-digits")
def test_a_number_outside_its_range_is_one_line_naming_the_range(
        tmp_path: Path, row: _Key, bad: str) -> None:
    path = write(tmp_path, f"[{row.section}]\n{row.key} = {bad}\n")
    assert isinstance(row.parse, (_Integer, _Duration))
    with pytest.raises(ConfigError, match=rf"\[{row.section}\] {row.key}: expected .*"
                                          rf"\b{row.parse.high}\b") as info:
        load_config(path, environ={})
    assert path in str(info.value) and "\n" not in str(info.value)


def _at(bound: str) -> str:
    """A file with every ranged key at its `bound` ("low" or "high"; a duration's low is
    its smallest whole second)."""
    sections: dict[str, list[str]] = {}
    for row in RANGED:
        value = getattr(row.parse, bound) if hasattr(row.parse, bound) else 1
        sections.setdefault(row.section, []).append(f"{row.key} = {value}\n")
    return "".join(f"[{name}]\n" + "".join(keys) for name, keys in sections.items())


@pytest.mark.parametrize("bound", ["low", "high"])
def test_every_number_at_its_bound_loads(tmp_path: Path, bound: str) -> None:
    """The bounds agree with each other (max_inflight_bytes >= max_body_bytes, a share <=
    its total) and each loads as itself."""
    config = load_config(write(tmp_path, _at(bound)), environ={})
    for row in RANGED:
        expected = getattr(row.parse, bound) if hasattr(row.parse, bound) else 1
        assert value(config, row.section, row.field) == expected, row


@pytest.mark.parametrize("key", ["socket_group", "tcp_allow_groups", "tcp_allow_uids"])
def test_ids_are_bounded_by_one_rule(tmp_path: Path, key: str) -> None:
    """Uids and gids alike: 0..MAX_UID, as an integer or (a gid) a string of digits."""
    def spelt(item: str) -> str:
        return f"[{item}]" if key != "socket_group" else item

    forms = [str(MAX_UID), "0"] + ([f'"{MAX_UID}"', '"0100"'] if key != "tcp_allow_uids" else [])
    for form in forms:
        load_config(write(tmp_path, f"[server]\n{key} = {spelt(form)}\n"), environ={})
    for form in [str(MAX_UID + 1), "-1"] + ([f'"{MAX_UID + 1}"'] if key != "tcp_allow_uids"
                                            else []):
        with pytest.raises(ConfigError, match=rf"\[server\] {key}: expected"):
            load_config(write(tmp_path, f"[server]\n{key} = {spelt(form)}\n"), environ={})


async def test_the_longest_retention_is_one_the_ledger_keeps(tmp_path: Path) -> None:
    """The ledger adds STALE_FACTOR x the retention to the clock in a SQLite integer. At the
    maximum a publishing record is written and replayed; past it (10**20 seconds, whose
    expiry overflowed SQLite and failed every publishing request) the file is refused."""
    from buzzwire.contract import Status
    from daemon.state.ledger import Fresh, Ledger, LedgerKey, Replay

    text = (f"[state]\nledger_retention = {MAX_RETENTION_SECONDS}\n"
            f"read_retention = {MAX_RETENTION_SECONDS}\n")
    state = load_config(write(tmp_path, text), environ={}).state
    ledger = Ledger.open(tmp_path / "ledger.db", retention_seconds=state.ledger_retention_seconds)
    try:
        key, digest = LedgerKey("a" * 64, "req-1"), bytes(32)
        begun = await ledger.begin(key, digest)
        assert isinstance(begun, Fresh)
        try:
            await ledger.record_pending(begun.ticket, b"signed work")
            await ledger.finish(begun.ticket, b"{}", Status.SUCCEEDED,
                                keep_seconds=state.read_retention_seconds)
        finally:
            ledger.release(begun.ticket)
        assert await ledger.begin(key, digest) == Replay(b"{}", Status.SUCCEEDED)
    finally:
        ledger.close()
    for key_name in ("ledger_retention", "read_retention"):
        with pytest.raises(ConfigError, match=rf"\[state\] {key_name}: expected"):
            load_config(write(tmp_path, f"[state]\n{key_name} = 100000000000000000000\n"),
                        environ={})


@pytest.mark.parametrize("key", ["runtimes", "providers", "models"])
def test_choice_lists_take_names_at_their_bounds(tmp_path: Path, key: str) -> None:
    # What a request may carry is what a list may declare: 300 characters, any script.
    names = ["x" * 300, "名前", *(f"m-{i}" for i in range(1022))]
    text = f"[policy]\n{key} = [" + ", ".join(f'"{n}"' for n in names) + "]\n"
    config = load_config(write(tmp_path, text), environ={})
    assert getattr(config.policy, key) == frozenset(names)
    assert len(names) == daemon.config.MAX_CHOICES


def test_a_bad_choice_is_named(tmp_path: Path) -> None:
    # The one bad name among many is quoted back, not just the (shortened) list.
    text = '[policy]\nmodels = ["gpt-5", "claude-sonnet-4 ", "o3"]\n'
    with pytest.raises(ConfigError,
                       match=r"\[policy\] models: expected .*'claude-sonnet-4 ' is not"):
        load_config(write(tmp_path, text), environ={})


@pytest.mark.parametrize(
    "url",
    ["ws://127.0.0.1:7777", "ws://localhost:7777/", "ws://[::1]:7777", "ws://127.8.9.10",
     "wss://relay.example.com", "wss://10.0.0.1:443/path"],
)
def test_relay_urls_accepted(tmp_path: Path, url: str) -> None:
    config = load_config(write(tmp_path, f'[relay]\nurl = "{url}"\n'), environ={})
    assert config.relay.url == url


@pytest.mark.parametrize(
    "url", ["ws://relay.example.com", "ws://10.0.0.1:7777", "ws://localhost.evil.com", "ws://[::2]"]
)
def test_plain_ws_refused_off_loopback(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match=r"\[relay\] url: expected wss://"):
        load_config(write(tmp_path, f'[relay]\nurl = "{url}"\n'), environ={})


#: A password written into a relay URL's user information (RFC 3986 §3.2.1).
_URL_PASSWORD = "Pw-7f3a9c2e5b1d8f40"
_REMOVED = "<user information removed>"


@pytest.mark.parametrize(("url", "shown"), [
    (f"wss://buzz:{_URL_PASSWORD}@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f"wss://:{_URL_PASSWORD}@relay.example.org/r", f"'wss://{_REMOVED}@relay.example.org/r'"),
    (f"wss://{_URL_PASSWORD}@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f"wss://buzz:{_URL_PASSWORD}@x@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f" wss://buzz:{_URL_PASSWORD}@relay.example.org", f"' wss://{_REMOVED}@relay.example.org'"),
    (f"ws://buzz:{_URL_PASSWORD}@10.0.0.1:7777", f"'ws://{_REMOVED}@10.0.0.1:7777'"),
    (f"//buzz:{_URL_PASSWORD}@relay.example.org", f"'//{_REMOVED}@relay.example.org'"),
    (f"wss://buzz:{_URL_PASSWORD}@relay.{'sub.' * 20}example.org", f"'wss://{_REMOVED}@relay."),
    (f"wss://buzz:Pw/{_URL_PASSWORD}@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f"wss://buzz:Pw#{_URL_PASSWORD}@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f"wss://buzz:Pw?{_URL_PASSWORD}@relay.example.org", f"'wss://{_REMOVED}@relay.example.org'"),
    (f"wss:buzz:{_URL_PASSWORD}@relay.example.org", f"'wss:{_REMOVED}@relay.example.org'"),
    (f"{_URL_PASSWORD}@relay.example.org", f"'{_REMOVED}@relay.example.org'"),
], ids=["user-password", "password-only", "user-only", "unescaped-at", "padded", "plain-ws",
        "no-scheme", "long", "slash-in-password", "hash-in-password", "query-in-password",
        "no-slashes", "no-scheme-no-slashes"])
@pytest.mark.parametrize("command", ["check-config", "status", "serve"])
def test_a_relay_url_with_user_information_is_refused_without_quoting_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, shown: str, command: str
) -> None:
    # Refused, and the refusal names what it refused with the user information (most
    # likely a password) replaced: it goes to stderr, under systemd the journal, which is
    # often readable more widely than the 0640 configuration.
    path = write(tmp_path, f'[relay]\nurl = "{url}"\n')
    assert main(["--config", path, command]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and _URL_PASSWORD not in err and "buzz:" not in err
    assert "[relay] url: expected " in err and f"got {shown}" in err


#: Relay URLs at the edges of the loopback rule and the pool's other rules (issue 16): a
#: name only /etc/hosts calls loopback, another case, a trailing dot, a fragment.
_EDGE_URLS = ["ws://ip6-localhost:7777", "ws://LOCALHOST:7777", "ws://localhost.:7777",
              "ws://localhost.localdomain", "ws://[::1]:7777", "ws://127.0.0.1:7777",
              "wss://relay.example.com/#frag", "ws://relay.example.com", "wss://h:0x1"]


@pytest.mark.parametrize("url", _EDGE_URLS)
def test_check_config_and_the_pool_agree_on_relay_urls(tmp_path: Path, url: str) -> None:
    # One rule: what check-config accepts, the pool's constructor accepts at start, and
    # what the pool refuses, check-config refuses (ip6-localhost once passed one and
    # failed the other).
    from daemon.relay.protocol import check_relay_url

    try:
        check_relay_url(url)
        pool_accepts = True
    except ValueError:
        pool_accepts = False
    try:
        load_config(write(tmp_path, f'[relay]\nurl = "{url}"\n'), environ={})
        config_accepts = True
    except ConfigError:
        config_accepts = False
    assert config_accepts == pool_accepts
    assert pool_accepts is (url in ("ws://LOCALHOST:7777", "ws://localhost.:7777",
                                    "ws://[::1]:7777", "ws://127.0.0.1:7777"))


def test_one_token_mapping(tmp_path: Path) -> None:
    text = ('[pkcs11]\nmodule = "/opt/p11.so"\ntoken_label = "t1"\npin_file = "/run/pin"\n'
            'kek_label = "k1"\n')
    token = load_config(write(tmp_path, text), environ={}).pkcs11.token()
    assert (token.module, token.token_label, token.pin_file, token.kek_label) == (
        "/opt/p11.so", "t1", "/run/pin", "k1")


def test_durations(tmp_path: Path) -> None:
    text = '[state]\nledger_retention = 90\n[server]\nrequest_timeout = "250ms"\n'
    with pytest.raises(ConfigError, match="request_timeout"):
        load_config(write(tmp_path, text), environ={})
    config = load_config(write(tmp_path, '[state]\nledger_retention = 90\n'), environ={})
    assert config.state.ledger_retention_seconds == 90
    config = load_config(write(tmp_path, '[state]\nledger_retention = "1d"\n'), environ={})
    assert config.state.ledger_retention_seconds == 86400


def test_integer_socket_mode(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[server]\nsocket_mode = 0o640\n"), environ={})
    assert config.server.socket_mode == 0o640


def test_bad_toml_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nsocket = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path, environ={})
    assert "\n" not in str(info.value) and path in str(info.value)


def test_duplicate_key_is_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[log]\nlevel = \"info\"\nlevel = \"debug\"\n"), environ={})


@pytest.mark.parametrize("text", [
    "[server]\nmax_connections = " + "9" * 4301 + "\n",  # tomllib: a plain ValueError
    "x = " + "[" * 100_000 + "]" * 100_000 + "\n",  # tomllib: RecursionError
], ids=["integer-over-4300-digits", "arrays-nested-too-deep"])
def test_toml_that_tomllib_cannot_hold_is_the_one_line(tmp_path: Path, text: str) -> None:
    # Both escaped as other exceptions than TOMLDecodeError: exit 70 on every command.
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_config(path, environ={})
    assert "\n" not in str(info.value) and path in str(info.value)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[pkcs11]\ntoken_label = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(str(path), environ={})


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "absent.toml"), environ={})
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path), environ={})


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO named as the file would block the open until a writer came: refused at once,
    as not a regular file (a thread holds the call, so a regression fails, not hangs)."""
    fifo = tmp_path / "broker.toml"
    os.mkfifo(fifo)
    outcome: list[object] = []

    def load() -> None:
        try:
            outcome.append(load_config(str(fifo), environ={}))
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked in open(): a writer's open releases it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("load_config waited on the FIFO")
    assert isinstance(outcome[0], ConfigError), outcome
    assert f"config {fifo}: not a regular file" in str(outcome[0])


def test_precedence_path_then_env_then_defaults(tmp_path: Path) -> None:
    from_arg = write(tmp_path, '[log]\nlevel = "error"\n', "arg.toml")
    from_env = write(tmp_path, '[log]\nlevel = "debug"\n', "env.toml")
    env = {ENV_VAR: from_env}
    assert load_config(from_arg, environ=env).log.level == "error"
    assert load_config(None, environ=env).log.level == "debug"
    assert load_config(None, environ=env).source == from_env
    assert load_config(None, environ={ENV_VAR: ""}).log.level == "info"
    assert load_config(None, environ={}).source is None


def test_precedence_flag_env_system_file_defaults(tmp_path: Path, no_system_file: Path) -> None:
    """--config > $BUZZ_BROKER_CONFIG > /etc/buzz-broker/broker.toml > built-in defaults."""
    from_arg = write(tmp_path, '[log]\nlevel = "error"\n', "arg.toml")
    from_env = write(tmp_path, '[log]\nlevel = "debug"\n', "env.toml")
    no_system_file.write_text('[log]\nlevel = "warning"\n')
    env = {ENV_VAR: from_env}
    chosen = [(c.log.level, c.origin) for c in (
        load_config(from_arg, environ=env),
        load_config(None, environ=env),
        load_config(None, environ={}),
    )]
    assert chosen == [("error", "--config"), ("debug", "$BUZZ_BROKER_CONFIG"),
                      ("warning", "system file")]
    assert load_config(None, environ={}).source == str(no_system_file)
    no_system_file.unlink()
    defaults = load_config(None, environ={})
    assert (defaults.log.level, defaults.origin, defaults.source) == (
        "info", "built-in defaults", None)
    # A file named on purpose must exist; the system file is optional.
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, environ={ENV_VAR: str(tmp_path / "gone.toml")})


def test_pin_from_credentials_directory_when_it_exists(tmp_path: Path) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    path = write(tmp_path, '[pkcs11]\npin_file = "/etc/elsewhere/pin"\n')
    env = {"CREDENTIALS_DIRECTORY": str(credentials)}
    # The directory without the credential: the configured file.
    config = load_config(path, environ=env)
    assert (config.pkcs11.pin_file, config.pkcs11.pin_origin) == (
        "/etc/elsewhere/pin", "[pkcs11] pin_file")
    (credentials / PIN_CREDENTIAL).write_text("1234\n")
    config = load_config(path, environ=env)
    assert (config.pkcs11.pin_file, config.pkcs11.pin_origin) == (
        str(credentials / PIN_CREDENTIAL), "systemd credential")
    # No pin_file at all (the default): the credential, else nothing.
    assert load_config(None, environ=env).pkcs11.pin_file == str(credentials / PIN_CREDENTIAL)
    bare = load_config(None, environ={})
    assert (bare.pkcs11.pin_file, bare.pkcs11.pin_origin) == (None, "none")


def test_relay_url_has_no_default(tmp_path: Path) -> None:
    from daemon.config import require_relay

    config = load_config(write(tmp_path, "[log]\nlevel = \"info\"\n"), environ={})
    assert config.relay.url is None
    with pytest.raises(ConfigError, match=r"\[relay\] url is not set") as info:
        require_relay(config)
    assert config.source is not None and config.source in str(info.value)


def test_action_names_match_the_contract() -> None:
    from buzzwire.contract import ACTIONS

    assert ACTION_NAMES == frozenset(ACTIONS)


def test_config_is_frozen() -> None:
    config = load_config(None, environ={})
    with pytest.raises(AttributeError):
        config.server.socket = "/elsewhere"  # type: ignore[misc]


# --------------------------------------------------------------------------- check-config


def test_check_config_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, EVERY_KEY)
    assert main(["check-config", path]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    risk = ("held by systemd (socket activation) if passed, else unheld: the operator "
            "accepted the squatting risk (listen_tcp_accept_squatting_risk)")
    # EVERY_KEY sets [custody] custodian_socket: the PIN is the custodian's, not read here.
    assert out == (f"config: {path} (check-config PATH)\npin: none here: the custodian holds the keys "
                   "(/run/bb/custodian.sock; the PIN is its unit's credential)\n"
                   f"tcp: 127.0.0.1:7475: {risk}\ntcp: [::1]:7475: {risk}\n"
                   "tcp: allowed peers: 1000, 1001, group buzz-agents; every credential\n"
                   f"metrics: [::1]:9464: {risk.replace('listen_tcp_accept', 'listen_accept')}"
                   "\nok\n")


def test_check_config_says_a_pin_file_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shallow check reads the file only, so a missing [pkcs11] pin_file is said on the
    pin: line (the deep check and `serve` refuse it), and the check still ends `ok`."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    pin = tmp_path / "token-pin"
    path = write(tmp_path, f'[relay]\nurl = "wss://relay.example.org"\n'
                           f'[pkcs11]\npin_file = "{pin}"\n')
    assert main(["check-config", path]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[1:] == [
        f"pin: {pin} ([pkcs11] pin_file; missing: `check-config --deep` and `serve` will "
        "refuse)", "ok"]
    pin.write_text("1234\n")
    assert main(["check-config", path]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [f"pin: {pin} ([pkcs11] pin_file)", "ok"]


def test_check_config_error_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[policy]\nmax_agent_depth = \"three\"\n")
    assert main(["check-config", path]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "[policy] max_agent_depth" in err and path in err
    assert "Traceback" not in err


@pytest.mark.parametrize("key", ["runtimes", "providers", "models"])
def test_check_config_names_a_bad_choice_list(tmp_path: Path, key: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, f'[policy]\n{key} = ["ok", 7]\n')
    assert main(["check-config", path]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert f"[policy] {key}: expected an array of at most 1024 names" in err and "7 is not" in err


def test_check_config_path_beats_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, '[relay]\nurl = "wss://relay.example.org"\n', "good.toml")
    bad = write(tmp_path, "[nope]\n", "bad.toml")
    assert main(["--config", bad, "check-config", good]) == 0
    assert main(["--config", bad, "check-config"]) == 1
    capsys.readouterr()


def test_check_config_uses_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_VAR, write(tmp_path, "[server]\nwhat = 1\n"))
    assert main(["check-config"]) == 1
    assert "unknown key [server] what" in capsys.readouterr().err
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing.toml"))
    assert main(["check-config"]) == 1
    monkeypatch.delenv(ENV_VAR)
    capsys.readouterr()
    # No file at all: the built-in defaults name no relay, refused, saying where a file
    # was looked for.
    assert main(["check-config"]) == 1
    err = capsys.readouterr().err
    assert "no configuration file (no --config, $BUZZ_BROKER_CONFIG unset or empty" in err
    assert "[relay] url is not set" in err


def test_serve_with_bad_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(tmp_path / "absent.toml"), "serve"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err


def test_env_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    before = dict(os.environ)
    load_config(None)
    assert dict(os.environ) == before


def test_inflight_budget_must_hold_one_largest_body(tmp_path: Path) -> None:
    # A budget smaller than one body could never admit the largest request: refused whole.
    path = write(tmp_path, "[server]\nmax_body_bytes = 4096\nmax_inflight_bytes = 2048\n")
    with pytest.raises(ConfigError, match=r"\[server\] max_inflight_bytes"):
        load_config(path, environ={})


def test_an_observer_share_larger_than_the_total_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[observer]\nmax_queued_bytes = 100000\n"
                           "max_queued_bytes_per_credential = 200000\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "max_queued_bytes_per_credential" in str(refused.value)


def test_the_observer_defaults_are_the_dataclass_defaults() -> None:
    from daemon.config import DEFAULT_OBSERVER

    assert load_config(None, environ={}, system_file="/nonexistent").observer == DEFAULT_OBSERVER


def test_listen_tcp_needs_someone_allowed(tmp_path: Path) -> None:
    """A TCP listener nobody may use is a config error, not a listener that refuses all."""
    path = write(tmp_path, '[server]\nlisten_tcp = ["127.0.0.1:7475"]\n')
    with pytest.raises(ConfigError, match=r"\[server\] listen_tcp: expected tcp_allow_uids"):
        load_config(path, environ={})


# --------------------------------------------------------------------------- [metrics] listen


#: [metrics] listen -> the rule check-config names for it: the same as listen_tcp's,
#: with its own opt-in and socket unit (serve applies it: tests/test_tcp_listener.py).
METRICS_RULES = {
    'listen = "127.0.0.1:9464"\n':
        "metrics: 127.0.0.1:9464: served only if systemd passes it "
        "(buzz-broker-metrics.socket); otherwise serve refuses it: any local user could bind "
        "it first",
    'listen = "127.0.0.1:9464"\nlisten_accept_squatting_risk = true\n':
        "metrics: 127.0.0.1:9464: held by systemd (socket activation) if passed, else "
        "unheld: the operator accepted the squatting risk (listen_accept_squatting_risk)",
    'listen = "[::1]:947"\n':
        "metrics: [::1]:947: served: a privileged port (only root can bind it first)",
}


def test_metrics_listen_is_under_the_squatting_rule_of_listen_tcp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port any user may bind loads (systemd may hold it: buzz-broker-metrics.socket) and
    check-config says which rule it is under, as for [server] listen_tcp."""
    for i, (metrics, line) in enumerate(METRICS_RULES.items()):
        code, out, err = _check_metrics(tmp_path, capsys, metrics, f"m{i}.toml")
        assert code == 0 and err == "" and f"\n{line}\n" in out, (metrics, out, err)


def test_metrics_opt_in_without_listen_is_harmless(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _check_metrics(tmp_path, capsys, "listen_accept_squatting_risk = true\n")
    assert code == 0 and "metrics:" not in out


def test_metrics_listen_needs_a_port_of_its_own(tmp_path: Path) -> None:
    """One passed socket could serve only one of them: the same address in [server]
    listen_tcp and [metrics] listen is refused at load."""
    path = write(tmp_path, '[server]\nlisten_tcp = ["127.0.0.1:7475"]\ntcp_allow_uids = [0]\n'
                           '[metrics]\nlisten = "127.0.0.1:7475"\n')
    with pytest.raises(ConfigError, match=r"\[metrics\] listen: 127\.0\.0\.1:7475 is in "
                                          r"\[server\] listen_tcp too"):
        load_config(path, environ={})


def _check_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str], metrics: str,
                   name: str = "broker.toml") -> tuple[int, str, str]:
    """`check-config` on a file with a relay and `metrics` as its [metrics] table."""
    path = write(tmp_path, f'[relay]\nurl = "wss://relay.example.org"\n[metrics]\n{metrics}', name)
    code = main(["check-config", path])
    out, err = capsys.readouterr()
    return code, out, err


MISSING = "missing: `check-config --deep` and `serve` will refuse"


def _pin_line(tmp_path: Path, pin: str, capsys: pytest.CaptureFixture[str]) -> str:
    path = write(tmp_path, f'[relay]\nurl = "wss://relay.example.org"\n'
                           f'[pkcs11]\npin_file = "{pin}"\n')
    assert main(["check-config", path]) == 0
    return capsys.readouterr().out.splitlines()[1]


def test_check_config_says_a_pin_file_below_a_file_is_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pin_file path through a regular file (ENOTDIR) has nothing at it either."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    (tmp_path / "secrets").write_text("a file where the directory was meant")
    assert MISSING in _pin_line(tmp_path, str(tmp_path / "secrets" / "token-pin"), capsys)


def test_check_config_does_not_call_a_dangling_link_or_an_unreadable_path_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Something is at a dangling link (not followed: the token refuses a link, and says
    so); a path this user may not look into may hold the daemon user's PIN: neither is
    said to be missing."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    link = tmp_path / "token-pin"
    link.symlink_to(tmp_path / "nowhere")
    assert MISSING not in _pin_line(tmp_path, str(link), capsys)
    hidden = str(tmp_path / "daemon-only" / "token-pin")
    real = os.lstat

    def lstat(path, *args, **kwargs):
        if str(path) == hidden:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(check_config.os, "lstat", lstat)
    assert MISSING not in _pin_line(tmp_path, hidden, capsys)


@pytest.mark.parametrize("inflight, loads", [(4096, True), (4095, False)])
def test_inflight_budget_of_exactly_one_body_loads_and_one_byte_less_does_not(
        tmp_path: Path, inflight: int, loads: bool) -> None:
    path = write(tmp_path, f"[server]\nmax_body_bytes = 4096\nmax_inflight_bytes = {inflight}\n")
    if loads:
        assert load_config(path, environ={}).server.max_inflight_bytes == inflight
    else:
        with pytest.raises(ConfigError, match=r"\[server\] max_inflight_bytes"):
            load_config(path, environ={})


@pytest.mark.parametrize("share, loads", [(100000, True), (100001, False)])
def test_an_observer_share_of_the_whole_total_loads_and_one_byte_more_does_not(
        tmp_path: Path, share: int, loads: bool) -> None:
    path = write(tmp_path, "[observer]\nmax_queued_bytes = 100000\n"
                           f"max_queued_bytes_per_credential = {share}\n")
    if loads:
        assert load_config(path, environ={}).observer.max_queued_bytes_per_credential == share
    else:
        with pytest.raises(ConfigError, match="max_queued_bytes_per_credential"):
            load_config(path, environ={})


@pytest.mark.parametrize("port, loads", [(65535, True), (65536, False)])
def test_listen_tcp_takes_the_last_port_and_refuses_one_past_it(
        tmp_path: Path, port: int, loads: bool) -> None:
    path = write(tmp_path, f'[server]\nlisten_tcp = ["127.0.0.1:{port}"]\n'
                           "tcp_allow_uids = [1000]\n")
    if loads:
        assert load_config(path, environ={}).server.listen_tcp == (("127.0.0.1", port),)
    else:
        with pytest.raises(ConfigError, match=r"\[server\] listen_tcp"):
            load_config(path, environ={})


def test_a_pin_credential_that_is_a_dangling_link_is_still_the_credential(
        tmp_path: Path) -> None:
    """The unit's credential wins whenever it is there (daemon/config.py, "The token PIN"):
    one that cannot be read is not silently replaced by [pkcs11] pin_file."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "token-pin").symlink_to(tmp_path / "gone")
    path = write(tmp_path, f'[pkcs11]\npin_file = "{tmp_path / "pin"}"\n')
    config = load_config(path, environ={"CREDENTIALS_DIRECTORY": str(credentials)})
    assert (config.pkcs11.pin_file, config.pkcs11.pin_origin) == (
        str(credentials / "token-pin"), "systemd credential")


@pytest.mark.parametrize("section, key", [("pkcs11", "token_label"), ("pkcs11", "kek_label"),
                                          ("state", "dir"), ("pkcs11", "module")])
def test_a_nul_in_a_text_value_is_one_line_naming_the_key(
        tmp_path: Path, section: str, key: str) -> None:
    path = write(tmp_path, f'[{section}]\n{key} = "a\\u0000b"\n')
    with pytest.raises(ConfigError, match=re.escape(f"[{section}] {key}")):
        load_config(path, environ={})


@pytest.mark.parametrize("label, loads", [("k" * 255, True), (" ~", True), ("k" * 256, False),
                                          ("café-kek", False), ("kek\t", False)])
def test_a_kek_label_no_sealed_key_can_name_is_refused_at_load(
        tmp_path: Path, label: str, loads: bool) -> None:
    """custody's rule for a label a blob can name (custody/_records.py `kek_label_ok`):
    check-config once passed "café-kek", and `keys init` then refused it."""
    path = write(tmp_path, f"[pkcs11]\nkek_label = {json.dumps(label)}\n")
    if loads:
        assert load_config(path, environ={}).pkcs11.kek_label == label
    else:
        with pytest.raises(ConfigError, match=r"\[pkcs11\] kek_label"):
            load_config(path, environ={})
