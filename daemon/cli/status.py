"""`buzz-broker status [--json]`: is the daemon running, and is everything it needs in order?

Rules:
- One line per fact, in this order: config (which file, by which rule), daemon (running with
  its pid, or stopped: from the run lock, daemon/state/runlock.py), socket (the configured
  path: a socket? its mode and owner), tcp ([server] listen_tcp and the squatting rule each
  port is under), metrics ([metrics] socket's path, [metrics] listen and its rule), token
  (login and KEK, daemon/cli/_probe.py), relay (WebSocket reachable), agents (live /
  deleted), credentials (active / revoked or expired), audit (records and head hash,
  verified). ``--json`` prints the same facts as one JSON object, each fact an object of
  typed members: always `ok` (bool) and `detail` (the line's text), then its own (`pid`,
  `mode`, `live`, `records`, …; absent when unknown, never null), with `running`, `ok` and
  `exit` at the top.
- It never connects to the agents' socket: under socket activation a connection starts
  the service, and status must not change what it reports on.
- It creates nothing: a missing keystore, credential store or audit log reads as none.
  (The one file it may write, as the daemon's user, is the directory's copy of a version-1
  keystore's names, which every opener of the directory makes: daemon/state/directory.py;
  no count changes.) Run it as the daemon's user (the `buzz-broker-admin` wrapper): the
  state directory is 0700 and the PIN is the unit's credential.
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
import os
import pwd
import sqlite3
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio

from buzzwire.contract import printable
from daemon.cli._common import CliError, config_from_args, print_json_line
from daemon.cli.check_config import describe, describe_metrics, describe_tcp
from daemon.cli.serve import METRICS_NOTE, SIBLING_TAKEN, TCP_NOTE
from daemon.config import Config, ConfigError, require_relay
from daemon.loopback_tcp import address_text

HELP = "show whether the daemon runs and whether its token, relay and stores are in order"

EXIT_OK = 0
EXIT_DEGRADED = 1
EXIT_NOT_RUNNING = 3


@dataclass(frozen=True, slots=True)
class Fact:
    """One line of status: whether it is in order, its text, and its typed members."""

    ok: bool
    detail: str
    data: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "detail": self.detail, **self.data}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object, on one line, instead of lines")


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


def _socket(path: str) -> Fact:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Fact(False, f"{path}: absent", {"path": path, "exists": False})
    except OSError as exc:
        return Fact(False, f"{path}: {exc.strerror}", {"path": path})
    if not stat.S_ISSOCK(st.st_mode):
        return Fact(False, f"{path}: not a socket", {"path": path, "exists": True})
    mode, owner = f"{stat.S_IMODE(st.st_mode):04o}", _owner(st)
    return Fact(True, f"{path}: socket, mode {mode}, {owner}",
                {"path": path, "exists": True, "mode": mode, "owner": owner})


def _agents(config: Config) -> Fact:
    """The directory's count (its key records the custodian's, when one holds the keys)."""
    from daemon.cli._common import agent_directory

    try:
        with agent_directory(config) as directory:
            records = directory.agents(include_deleted=True)
    except CliError as exc:
        return Fact(False, str(exc))
    live = sum(1 for r in records if r.live)
    deleted = len(records) - live
    return Fact(True, f"{live} live, {deleted} deleted", {"live": live, "deleted": deleted})


def _credentials(state_dir: Path) -> Fact:
    from daemon.state.sessions import SESSIONS_FILENAME, SessionStore

    path = state_dir / SESSIONS_FILENAME
    if not path.exists():  # SessionStore.open would create it: status creates nothing
        return Fact(True, "0 active (no credential store yet)", {"active": 0, "inactive": 0})
    try:
        store = SessionStore.open(state_dir)
        try:
            infos = store.list()
        finally:
            store.close()
    except (sqlite3.Error, OSError) as exc:
        return Fact(False, f"cannot read {path}: {exc}")
    now = int(time.time())
    active = sum(1 for info in infos if info.active(now))
    inactive = len(infos) - active
    return Fact(True, f"{active} active, {inactive} revoked or expired",
                {"active": active, "inactive": inactive})


def _audit(state_dir: Path) -> Fact:
    from daemon.state.audit import AUDIT_DIRNAME, verify

    path = state_dir / AUDIT_DIRNAME
    if not path.exists():
        return Fact(True, "no audit log yet", {"records": 0})
    try:
        result = verify(path)
    except OSError as exc:
        return Fact(False, f"cannot read {path}: {exc.strerror}")
    if not result.ok:
        return Fact(False, f"broken: {result.reason} (run `buzz-broker audit verify`)",
                    {"records": result.records})
    return Fact(True, f"{result.records} records, head {result.head}",
                {"records": result.records, "seq": result.seq, "head": result.head})


def _tcp(config: Config, state_dir: Path, running: bool) -> Fact:
    """What the running daemon serves on TCP and why (its note), else the config's rule."""
    listen = [address_text(h, p) for h, p in config.server.listen_tcp]
    if running:
        try:
            served = (state_dir / TCP_NOTE).read_text(encoding="utf-8").splitlines()
        except OSError:
            served = []
        if served:
            # False: another process holds the other loopback of a served port (serve.py
            # `hold_siblings`), where an agent's `localhost` may reach it first.
            return Fact(not any(SIBLING_TAKEN in line for line in served),
                        "serving " + "; ".join(served), {"listen": listen, "serving": served})
    rules = describe_tcp(config)
    if not rules:
        return Fact(True, "off ([server] listen_tcp is empty; agents use the Unix socket)",
                    {"listen": listen})
    return Fact(True, "; ".join(line.removeprefix("tcp: ") for line in rules),
                {"listen": listen})


def _metrics(config: Config, state_dir: Path, running: bool) -> Fact:
    """Where the metrics are served: [metrics] socket (its path), then [metrics] listen
    (`_metrics_listen`); "off" only when both are empty."""
    path, listen = config.metrics.socket, _metrics_listen(config, state_dir, running)
    on_socket = Fact(True, f"socket {path}", {"socket": path}) if path else None
    served = [fact for fact in (on_socket, listen) if fact is not None]
    if not served:
        return Fact(True, "off ([metrics] socket and listen are empty)")
    return Fact(all(fact.ok for fact in served), "; ".join(fact.detail for fact in served),
                {key: value for fact in served for key, value in fact.data.items()})


def _metrics_listen(config: Config, state_dir: Path, running: bool) -> Fact | None:
    """[metrics] listen: what the running daemon serves it under (its note), else the
    config's rule, as for `tcp`; None when it is empty."""
    listen, line = config.metrics.listen, describe_metrics(config)
    if listen is None or line is None:
        return None
    facts = {"listen": address_text(*listen)}
    if running:
        try:
            lines = (state_dir / METRICS_NOTE).read_text(encoding="utf-8").splitlines()
        except OSError:
            lines = []
        if lines:
            served = "; ".join(lines)
            return Fact(SIBLING_TAKEN not in served, f"serving {served}",
                        {**facts, "serving": served})
    return Fact(True, line.removeprefix("metrics: "), facts)


def gather(config: Config) -> tuple[dict[str, Fact], bool, bool]:
    """The facts by name, whether the daemon runs, whether every check passed."""
    from daemon.cli._probe import check_relay, check_token_and_kek
    from daemon.state.runlock import running_pid

    state_dir = Path(config.state.dir)
    facts: dict[str, Fact] = {"config": Fact(True, describe(config).removeprefix("config: "), {
        "origin": config.origin if config.source is not None else "built-in defaults",
        **({"path": str(config.source)} if config.source is not None else {})})}
    all_ok = True
    try:
        pid = running_pid(state_dir)
    except OSError as exc:
        raise CliError(f"cannot read {state_dir}: {exc.strerror}; run status as the daemon's "
                       "user (buzz-broker-admin status)") from None
    facts["daemon"] = Fact(
        True, f"running (pid {pid})" if pid and pid > 0 else ("running" if pid else "stopped"),
        {"running": bool(pid), **({"pid": pid} if pid and pid > 0 else {})})
    socket = _socket(config.server.socket)
    # An absent socket is a fault only while the daemon runs (a stopped daemon without
    # socket activation has none).
    facts["socket"] = socket
    all_ok &= socket.ok or not pid
    facts["tcp"] = _tcp(config, state_dir, bool(pid))
    facts["metrics"] = _metrics(config, state_dir, bool(pid))
    all_ok &= facts["tcp"].ok and facts["metrics"].ok
    for check in (check_token_and_kek, check_relay):
        result = trio.run(check, config)
        facts[result.name] = Fact(result.ok, result.detail)
        all_ok &= result.ok
    facts["agents"] = _agents(config)
    all_ok &= facts["agents"].ok
    for name, probe in (("credentials", _credentials), ("audit", _audit)):
        facts[name] = probe(state_dir)
        all_ok &= facts[name].ok
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
        print_json_line({**{name: fact.to_json() for name, fact in facts.items()},
                         "running": running, "ok": all_ok, "exit": code})
    else:
        width = max(len(k) for k in facts) + 1
        for key, fact in facts.items():
            # A fact may quote a store's fault text: escaped like all agent-reachable text.
            print(f"{key + ':':<{width}} {'' if fact.ok else 'FAILED: '}{printable(fact.detail)}")
    return code
