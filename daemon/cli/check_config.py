"""`buzz-broker check-config [PATH] [--deep]`: validate a configuration, and with --deep the setup.

Rules:
- Which file: PATH if given, else the global ``--config``, else ``$BUZZ_BROKER_CONFIG``,
  else /etc/buzz-broker/broker.toml if it exists, else the built-in defaults (checked like
  a file). The first line on stdout names what was read and why (``config: <file>
  (check-config PATH)``, ``(--config)``, ... or ``config: built-in defaults (no file ...)``); the second where the PIN
  will come from, and that a ``[pkcs11] pin_file`` with nothing at its path is missing.
  No silent default.
- ``[relay] url`` must be set (there is no default relay): the daemon would refuse to start.
- Without --deep it checks the file only (a config is often checked on another machine):
  ``ok`` last on stdout, exit 0; or the one-line `ConfigError` on stderr, exit 1. A
  ``[state] dir`` that exists here and is not a directory is that line too (every state
  command refuses it: `_common.refuse_unusable_state`).
- With --deep it also logs in to the token, finds and checks the KEK, opens a
  WebSocket to the relay, checks that this user can make files in the state directory
  and looks up the groups ``[server]`` names (daemon/cli/_probe.py), one line each;
  any failure is the one-line error on stderr (naming the step) and exit 1. Run it as the daemon runs (the
  `buzz-broker-admin` wrapper), so the PIN credential and the token files are its own.

WARNING: the output lines and the exit codes are documented in docs/configuration.md and
docs/install.md (step 4); tests/test_check_config.py checks them.
"""

from __future__ import annotations

import argparse
import os

import trio

from daemon.cli._common import CliError, refuse_unusable_state
from daemon.loopback_tcp import address_text
from daemon.config import (ACTION_TCP, METRICS_TCP, SYSTEM_CONFIG, Config, ConfigError,
                           load_config, require_relay)

HELP = "validate a configuration; --deep also logs in to the token and reaches the relay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="the file to check (default: --config, $BUZZ_BROKER_CONFIG, "
        f"{SYSTEM_CONFIG}, built-in defaults)",
    )
    parser.add_argument(
        "--deep",
        action="store_true",
        help="also log in to the token, check the KEK, open a WebSocket to the relay and "
        "check the state directory is this user's to write",
    )


def describe(config: Config) -> str:
    """The ``config:`` line: which file was read and by which rule."""
    if config.source is None:
        return (f"config: built-in defaults (no --config, no $BUZZ_BROKER_CONFIG, "
                f"no {SYSTEM_CONFIG})")
    return f"config: {config.source} ({config.origin})"


def describe_pin(config: Config) -> str:
    """The ``pin:`` line: where the token PIN will be read from (never the PIN)."""
    pkcs11 = config.pkcs11
    if config.custody.custodian_socket:
        return ("pin: none here: the custodian holds the keys "
                f"({config.custody.custodian_socket}; the PIN is its unit's credential)")
    if pkcs11.pin_file is None:
        return ("pin: none here (no $CREDENTIALS_DIRECTORY/token-pin and no [pkcs11] "
                "pin_file; under the unit, LoadCredential= provides it)")
    if _nothing_at(pkcs11.pin_file):
        # Said, not refused: the shallow check reads the file only, often on another
        # machine than the one the PIN file lives on (as `pin: none here` above).
        return (f"pin: {pkcs11.pin_file} ({pkcs11.pin_origin}; missing: "
                "`check-config --deep` and `serve` will refuse)")
    return f"pin: {pkcs11.pin_file} ({pkcs11.pin_origin})"


def _nothing_at(path: str) -> bool:
    """Nothing at `path` at all (not followed: the token refuses a link anyway). A path
    this user may not look into is not said to be missing: the daemon's user may see it."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def describe_tcp(config: Config) -> list[str]:
    """One ``tcp:`` line per [server] listen_tcp address (none when it is empty): which squatting rule lets it be
    served (daemon/loopback_tcp.py), or that `serve` will refuse it. Whether systemd holds
    a port is known only at start (the fd it passes), so this says what each case does."""
    server = config.server
    if not server.listen_tcp:
        return []
    lines = [f"tcp: {address_text(host, port)}: "
             f"{ACTION_TCP.rule(port, accept_risk=server.listen_tcp_accept_squatting_risk)}"
             for host, port in server.listen_tcp]
    who = sorted(map(str, server.tcp_allow_uids)) + sorted(f"group {g}"
                                                          for g in server.tcp_allow_groups)
    creds = ("every credential" if server.tcp_allow_credentials_without_uid
             else "uid-bound credentials only")
    lines.append(f"tcp: allowed peers: {', '.join(who)}; {creds}")
    return lines


def describe_metrics(config: Config) -> str | None:
    """The ``metrics:`` line for [metrics] listen (None when it is off): its squatting
    rule, each case spelled out as for ``tcp:`` (buzz-broker-metrics.socket may hold it)."""
    metrics = config.metrics
    if metrics.listen is None:
        return None
    rule = METRICS_TCP.rule(metrics.listen[1], accept_risk=metrics.listen_accept_squatting_risk)
    return f"metrics: {address_text(*metrics.listen)}: {rule}"


def run(args: argparse.Namespace) -> int:
    given = getattr(args, "path", None)
    # not `or`: an empty PATH is refused, not replaced by the default file
    path = given if given is not None else getattr(args, "config", None)
    try:
        config = load_config(path, os.environ, path_origin="--config" if given is None
                             else "check-config PATH")
        require_relay(config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    refuse_unusable_state(config)  # what every state command would refuse, said here first
    print(describe(config))
    print(describe_pin(config))
    for line in describe_tcp(config):
        print(line)
    if (metrics := describe_metrics(config)) is not None:
        print(metrics)
    if getattr(args, "deep", False):
        from daemon.cli._probe import check_groups, check_relay, check_state, check_token_and_kek

        for check in (check_token_and_kek, check_relay, check_state, check_groups):
            result = trio.run(check, config)
            if result is None:  # nothing of the kind configured
                continue
            if not result.ok:
                raise CliError(f"check-config --deep: {result.name}: {result.detail}")
            print(f"{result.name}: {result.detail}")
    print("ok")
    return 0
