"""`buzz-broker status [--json]`: is the daemon running, and is everything it needs in order?

Rules:
- One line per fact, in this order: config (which file, by which rule), daemon (running
  with its pid, or stopped: from the run lock, daemon/state/runlock.py), socket (the configured
  path: a socket? its mode and owner), token (login and KEK, daemon/probe.py), relay
  (WebSocket reachable), agents (live / deleted), credentials (active / revoked or
  expired), audit (records and head hash, verified). ``--json`` prints the same facts as
  one JSON object.
- It never connects to the agents' socket: under socket activation a connection starts
  the service, and status must not change what it reports on.
- It creates nothing: a missing keystore, credential store or audit log reads as none.
  Run it as the daemon's user (the `buzz-broker-admin` wrapper): the state directory is
  0700 and the PIN is the unit's credential.
- Exit status: 0 running and every check ok; 1 running but a check failed (or the
  configuration is unusable); 3 not running (LSB "program is not running"; under socket
  activation that is normal until the first request).
- Never a secret: counts, ids of nothing, paths, and the audit head hash (a public anchor).

WARNING: docs/install.md ("Check") shows this output; tests/test_status.py checks it on a
running and a stopped daemon.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import sqlite3
import stat
import time
from pathlib import Path

import trio

from daemon.cli._common import CliError, config_from_args
from daemon.cli.check_config import describe, describe_tcp
from daemon.cli.serve import TCP_NOTE
from daemon.config import Config, ConfigError, require_relay

HELP = "show whether the daemon runs and whether its token, relay and stores are in order"

EXIT_OK = 0
EXIT_DEGRADED = 1
EXIT_NOT_RUNNING = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def _socket(path: str) -> tuple[bool, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, f"{path}: absent"
    except OSError as exc:
        return False, f"{path}: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return False, f"{path}: not a socket"
    return True, f"{path}: socket, mode {stat.S_IMODE(st.st_mode):04o}, {_owner(st)}"


def _agents(state_dir: Path) -> tuple[bool, str]:
    from daemon.state.directory import AgentDirectory, DirectoryError

    directory = AgentDirectory.open(state_dir)
    try:
        records = directory.agents(include_deleted=True)
    except DirectoryError as exc:
        return False, str(exc)
    finally:
        directory.close()
    live = sum(1 for r in records if r.live)
    return True, f"{live} live, {len(records) - live} deleted"


def _credentials(state_dir: Path) -> tuple[bool, str]:
    from daemon.state.sessions import SESSIONS_FILENAME, SessionStore

    path = state_dir / SESSIONS_FILENAME
    if not path.exists():  # SessionStore.open would create it: status creates nothing
        return True, "0 active (no credential store yet)"
    try:
        store = SessionStore.open(state_dir)
        try:
            infos = store.list()
        finally:
            store.close()
    except (sqlite3.Error, OSError) as exc:
        return False, f"cannot read {path}: {exc}"
    now = int(time.time())
    active = sum(1 for info in infos if info.active(now))
    return True, f"{active} active, {len(infos) - active} revoked or expired"


def _audit(state_dir: Path) -> tuple[bool, str]:
    from daemon.state.audit import AUDIT_DIRNAME, verify

    path = state_dir / AUDIT_DIRNAME
    if not path.exists():
        return True, "no audit log yet"
    try:
        result = verify(path)
    except OSError as exc:
        return False, f"cannot read {path}: {exc.strerror}"
    if not result.ok:
        return False, f"broken: {result.reason} (run `buzz-broker audit verify`)"
    return True, f"{result.records} records, head {result.head}"


def _tcp(config: Config, state_dir: Path, running: bool) -> str:
    """What the running daemon serves on TCP and why (its note), else the config's rule."""
    if running:
        try:
            served = (state_dir / TCP_NOTE).read_text(encoding="utf-8").splitlines()
        except OSError:
            served = []
        if served:
            return "serving " + "; ".join(served)
    rules = describe_tcp(config)
    if not rules:
        return "off ([server] listen_tcp is empty; agents use the Unix socket)"
    return "; ".join(line.removeprefix("tcp: ") for line in rules)


def gather(config: Config) -> tuple[dict[str, str], bool, bool]:
    """The facts (name -> one line), whether the daemon runs, whether every check passed."""
    from daemon.probe import check_relay, check_token_and_kek
    from daemon.state.runlock import running_pid

    state_dir = Path(config.state.dir)
    facts: dict[str, str] = {"config": describe(config).removeprefix("config: ")}
    all_ok = True
    try:
        pid = running_pid(state_dir)
    except OSError as exc:
        raise CliError(f"cannot read {state_dir}: {exc.strerror}; run status as the daemon's "
                       "user (buzz-broker-admin status)") from None
    facts["daemon"] = f"running (pid {pid})" if pid and pid > 0 else (
        "running" if pid else "stopped")
    for name, (ok, line) in (("socket", _socket(config.server.socket)),):
        facts[name] = line
        # An absent socket is a fault only while the daemon runs (a stopped daemon without
        # socket activation has none).
        all_ok &= ok or not pid
    facts["tcp"] = _tcp(config, state_dir, bool(pid))
    for check in (check_token_and_kek, check_relay):
        result = trio.run(check, config)
        facts[result.name] = result.detail if result.ok else f"FAILED: {result.detail}"
        all_ok &= result.ok
    for name, probe in (("agents", _agents), ("credentials", _credentials), ("audit", _audit)):
        ok, line = probe(state_dir)
        facts[name] = line if ok else f"FAILED: {line}"
        all_ok &= ok
    return facts, bool(pid), all_ok


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        require_relay(config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    facts, running, all_ok = gather(config)
    code = EXIT_NOT_RUNNING if not running else (EXIT_OK if all_ok else EXIT_DEGRADED)
    if args.json:
        print(json.dumps({**facts, "running": running, "ok": all_ok, "exit": code}))
    else:
        width = max(len(k) for k in facts) + 1
        for key, value in facts.items():
            print(f"{key + ':':<{width}} {value}")
    return code
