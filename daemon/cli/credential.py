"""`buzz-broker credential issue|grant|list|revoke`: the operator's side of daemon/state/sessions.

Rules:
- `issue` prints the new token alone on stdout, once, followed by a newline, and
  nothing else there (so `TOKEN=$(buzz-broker credential issue ...)` just works). The
  credential id goes to stderr for the operator's records. The token is never printed
  again: `list` shows ids and scopes only.
- The agent must be held by the keystore and not deleted (read through
  `daemon.state.directory`, no token needed). Channels are normalized to the canonical
  lowercase UUID form the spec defines.
- Safe defaults (issue 13): the scope is always said out loud — `--action NAME`
  (repeatable, each one this build offers), `--preset NAME` (a named list, `PRESETS`) or
  `--all-actions`, never none. `--all-actions` means every action this build offers at
  the moment of issue, stored as that explicit list: a later release's new actions never
  reach an existing credential on their own (issue 23).
- `grant ID` adds actions (`--action`, `--preset`, `--all-actions`) to an active
  credential and removes none; it is the one way a live credential gains an action. It
  says on stderr what was added, and which of a preset's actions this build does not
  offer (those are left out, never stored as names the daemon would not know). `--ttl` takes
  30s / 30m / 12h / 7d, or `never`; absent, the credential lives `DEFAULT_TTL` (30 days:
  long enough that an agent is not cut off mid-task, short enough that a forgotten token
  dies on its own; rotation is `issue` then `revoke`). The uid is said out loud too
  (issue 22): `--uid UID` (a number or a local user's name) binds the credential to the
  agent's Unix user, `--any-uid` lets any local process that holds the token use it (and
  `issue` says so on stderr); neither is refused. There is no default uid: the operator
  runs `issue` as root or as the daemon's user, never as the agent, so the caller's own
  uid would be the wrong one.
- `list` shows label, agent, actions, channels, uid, expiry and last use (last use as the
  daemon last wrote it: up to `LAST_USE_FLUSH_SECONDS` behind, see daemon/state/sessions).
- Faults raise CliError with one line that never holds a token; a malformed argument
  (`--agent`, `--channel`, `--action`, `--ttl`, `--uid`, `--label`, `--rate`, `ID`) a
  UsageError, exit 2, before anything is read (tests/test_exit_codes.py).
- The running daemon sees a new or revoked credential on its next request (it checks
  the database's change counter per request; see daemon/state/sessions), so no SIGHUP needed.

WARNING: README.md ("The command line"), docs/install.md (step 6) and, for `--rate`,
docs/operations.md show these flags; keep them in step with `add_arguments`.
"""

from __future__ import annotations

import argparse
import json
import pwd
import re
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from daemon.cli._common import (CliError, UsageError, agent_directory, config_from_args,
                                print_json_line)
from daemon.config import MAX_UID, is_uid

if TYPE_CHECKING:
    from daemon.state.sessions import SessionStore

HELP = "issue, grant, list and revoke agent credentials"

#: Named action lists for `--preset`. `buzz-runtime`: what Buzz's 15-action agent runtime
#: calls (shared/spec/buzz-client.md): storage.address and storage.get at start (its core
#: memory read is not best-effort: without it the runtime cannot start), channel.read to
#: poll, message.post/reply and reaction.add to answer, and the four live signals.
PRESETS: Final[dict[str, tuple[str, ...]]] = {
    "buzz-runtime": (
        "storage.address", "storage.get", "channel.read", "message.post", "message.reply",
        "reaction.add", "presence.set", "typing.set", "observer.emit", "liveness.ping",
    ),
}

#: Duration suffix -> seconds.
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE: Final = re.compile(r"([1-9][0-9]{0,8})([smhd])")

#: `--ttl` when none is given (see the module docstring for why 30 days).
DEFAULT_TTL: Final = "30d"
#: `--ttl` spelling for a credential that does not expire (revocation is then the control).
TTL_NEVER: Final = "never"

#: What `issue --any-uid` says on stderr: the credential is bound to no Unix user.
NO_UID_WARNING: Final = (
    "warning: --any-uid: any local process that can reach the socket and holds this "
    "token can use it; pass --uid UID instead to bind it to the agent's Unix user"
)


def parse_duration(text: str) -> int:
    """`30m` -> 1800. Raises UsageError naming the accepted forms."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None:
        raise UsageError("--ttl: expected a duration like 30s, 30m, 12h or 7d, or never")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_uid(text: str) -> int:
    """`--uid`: a non-negative number, or the name of a local user (its uid).

    Raises UsageError for a number no uid can be, or text no user name can be (a NUL);
    CliError (exit 1) for a name no local user has: this host's users are its state. The
    text is not echoed (like `--channel`, it may be a mis-paste).
    """
    text = text.strip()
    if text.isascii() and text.isdigit():  # str.isdigit alone takes "²" and other digits
        if len(text) <= len(str(MAX_UID)) and is_uid(int(text)):
            return int(text)
        raise UsageError(f"--uid: a uid is at most {MAX_UID}")
    refused = "--uid: expected a non-negative uid or the name of a local user"
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise CliError(refused) from None
    except ValueError:
        raise UsageError(refused) from None


def parse_ttl(text: str) -> int | None:
    """`--ttl`: seconds, or None for `never`."""
    return None if text.strip() == TTL_NEVER else parse_duration(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="credential_command", metavar="SUBCOMMAND")
    sub.required = True

    issue = sub.add_parser("issue", help="issue a credential; prints the token once on stdout")
    issue.add_argument("--agent", required=True, metavar="HEX", help="the agent's public key")
    issue.add_argument(
        "--channel",
        required=True,
        action="append",
        metavar="UUID",
        help="a channel the credential is bound to (repeat for several)",
    )
    scope = issue.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--action",
        action="append",
        default=None,
        metavar="NAME",
        help="an action the credential allows (repeat for several)",
    )
    _scope_arguments(scope)
    issue.add_argument(
        "--ttl",
        metavar="DURATION",
        default=DEFAULT_TTL,
        help=f"lifetime: 30m, 12h, 7d, or {TTL_NEVER} (default: {DEFAULT_TTL})",
    )
    bound = issue.add_mutually_exclusive_group(required=True)
    bound.add_argument(
        "--uid", metavar="UID", help="the Unix user the agent runs as: a uid or a user name"
    )
    bound.add_argument(
        "--any-uid", action="store_true",
        help="bind no Unix user: the token alone is enough (say so explicitly)",
    )
    issue.add_argument("--label", metavar="TEXT", help="a note shown by `credential list`")
    issue.add_argument(
        "--rate",
        action="append",
        default=None,
        metavar="RULE",
        help="a rate limit or quota for this credential, overriding the host's: "
        "SCOPE=COUNT/WINDOW (message.post=30/min, publish=10/s, read=100/h, "
        "publish=500/day) or daily=N (repeat; see docs/operations.md)",
    )
    issue.set_defaults(_credential=_issue)

    grant = sub.add_parser(
        "grant", help="add actions to an active credential (removes none)")
    grant.add_argument("credential_id", metavar="ID")
    more = grant.add_mutually_exclusive_group(required=True)
    more.add_argument("--action", action="append", default=None, metavar="NAME",
                      help="an action to add (repeat for several)")
    _scope_arguments(more)
    grant.set_defaults(_credential=_grant)

    listing = sub.add_parser("list", help="list credentials (ids and scopes, never tokens)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(_credential=_list)

    revoke = sub.add_parser("revoke", help="revoke a credential by id")
    revoke.add_argument("credential_id", metavar="ID")
    revoke.set_defaults(_credential=_revoke)


def _scope_arguments(group: argparse._MutuallyExclusiveGroup) -> None:
    group.add_argument(
        "--preset", choices=sorted(PRESETS), metavar="NAME",
        help=f"a named list of actions: {', '.join(sorted(PRESETS))} (see docs/operations.md)",
    )
    group.add_argument(
        "--all-actions", action="store_true",
        help="every action this build offers now, stored explicitly (say so explicitly)",
    )


def _chosen_actions(args: argparse.Namespace) -> frozenset[str]:
    """The actions `--action`/`--preset`/`--all-actions` name, all offered by this build.

    A preset's names this build does not offer are left out and said on stderr; a named
    `--action` this build does not offer is refused.
    """
    from buzzwire.contract import ACTIONS

    if args.all_actions:
        return frozenset(ACTIONS)
    if args.preset is not None:
        preset = PRESETS[args.preset]
        missing = [a for a in preset if a not in ACTIONS]
        if missing:
            print(f"preset {args.preset}: not offered by this build, left out: "
                  f"{', '.join(missing)}", file=sys.stderr)
        return frozenset(a for a in preset if a in ACTIONS)
    actions = frozenset(args.action)
    unknown = sorted(actions - frozenset(ACTIONS))
    if unknown:
        raise UsageError(
            f"--action: unknown action {unknown[0]!r}; expected one of {', '.join(sorted(ACTIONS))}"
        )
    return actions


def run(args: argparse.Namespace) -> int:
    code: int = args._credential(args)
    return code


def _store(args: argparse.Namespace) -> "SessionStore":
    from daemon.state.sessions import SessionStore

    config = config_from_args(args)
    try:
        return SessionStore.open(Path(config.state.dir))
    except Exception as exc:  # noqa: BLE001 - an operator needs one line, not a traceback
        # The system's, SQLite's or the store's own reason names a path at most, never a
        # row; anything else only by its type.
        reason = (exc.strerror or str(exc) if isinstance(exc, OSError)
                  else str(exc) if isinstance(exc, (sqlite3.Error, ValueError))
                  else type(exc).__name__)
        raise CliError(f"cannot open the credential store in {config.state.dir}: {reason}"
                       ) from None


def _issue(args: argparse.Namespace) -> int:
    from buzzwire.contract import normalize_channel_id, normalize_hex64
    from daemon.state.ratelimit import RateLimiter, parse_rate
    from daemon.state.sessions import check_label

    agent = normalize_hex64(args.agent)
    if agent is None:
        raise UsageError("--agent: expected the agent's public key as 64 hex characters")
    channels: set[str] = set()
    for raw in args.channel:
        channel = normalize_channel_id(raw)
        if channel is None:
            # The value is not echoed: a mis-pasted token must not land in a terminal log.
            raise UsageError("--channel: expected a channel UUID")
        channels.add(channel)
    # argparse makes --action, --preset and --all-actions exclusive and one required.
    actions = _chosen_actions(args)
    ttl = parse_ttl(args.ttl)
    # argparse makes --uid and --any-uid exclusive and one of them required.
    uid = None if args.any_uid else parse_uid(args.uid)
    label = args.label
    try:
        check_label(label)
    except ValueError as exc:
        raise UsageError(f"--label: {exc}") from None
    rules = []
    for text in args.rate or ():
        try:
            rules.append(parse_rate(text))
        except ValueError as exc:
            raise UsageError(f"--rate: {exc}") from None

    config = config_from_args(args)
    with agent_directory(config) as directory:
        record = directory.get(agent)
    if record is None:
        raise CliError(f"no such agent held here: {agent}")
    if record.deleted_at is not None:
        raise CliError(f"agent {agent} is deleted; it cannot be given a credential")

    store = _store(args)
    try:
        credential_id, token = store.issue(
            agent=agent,
            channels=frozenset(channels),
            actions=actions,
            ttl_seconds=ttl,
            uid=uid,
            now=int(time.time()),
            label=label,
        )
    finally:
        store.close()
    if rules:
        limiter = RateLimiter.open(Path(config.state.dir), config.limits)
        try:
            limiter.set_overrides(credential_id, rules)
        except ValueError as exc:
            # Nothing half-done: a credential without the limits asked for is withdrawn.
            store = _store(args)
            try:
                store.revoke(credential_id)
            finally:
                store.close()
            raise CliError(f"--rate: {exc}; credential withdrawn") from None
        finally:
            limiter.close()
    if uid is None:
        print(NO_UID_WARNING, file=sys.stderr)
    print(f"issued {credential_id} for agent {agent}", file=sys.stderr)
    sys.stdout.write(token + "\n")
    sys.stdout.flush()
    return 0


def _list(args: argparse.Namespace) -> int:
    from daemon.state.sessions import SESSIONS_FILENAME

    # SessionStore.open would create the store (and the directory): a listing creates
    # nothing, as `status` does not, so root listing before the install leaves no root file.
    if not (Path(config_from_args(args).state.dir) / SESSIONS_FILENAME).exists():
        return 0
    store = _store(args)
    try:
        infos = store.list()
    finally:
        store.close()
    now = int(time.time())
    for info in infos:
        state = "active" if info.active(now) else ("revoked" if info.revoked_at else "expired")
        if args.json:
            print_json_line({
                "id": info.credential_id,
                "agent": info.agent,
                "channels": list(info.channels),
                "actions": list(info.actions),
                "createdAt": info.created_at,
                "expiresAt": info.expires_at,
                "uid": info.uid,
                "revokedAt": info.revoked_at,
                "label": info.label,
                "lastUsedAt": info.last_used_at,
                "state": state,
            })
        else:
            uid = "-" if info.uid is None else str(info.uid)
            # The label is the operator's own text, printable by construction; quoted so a
            # space in it cannot be read as the next column.
            label = "-" if info.label is None else json.dumps(info.label, ensure_ascii=False)
            print(
                f"{info.credential_id}  {state:<7}  label={label}  agent={info.agent}  "
                f"actions={','.join(info.actions)}  channels={','.join(info.channels)}  "
                f"uid={uid}  expires={_when(info.expires_at, 'never')}  "
                f"last-used={_when(info.last_used_at, 'never')}"
            )
    return 0


def _when(at: int | None, absent: str) -> str:
    return absent if at is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _grant(args: argparse.Namespace) -> int:
    from daemon.state.sessions import CREDENTIAL_ID_RE

    if CREDENTIAL_ID_RE.fullmatch(args.credential_id) is None:
        # Not echoed: an operator who pastes a token here must not see it printed back.
        raise UsageError("ID: expected a credential id (cred_ followed by 16 hex characters)")
    actions = _chosen_actions(args)
    if not actions:
        raise CliError("nothing to grant: this build offers none of those actions")
    store = _store(args)
    try:
        added = store.grant(args.credential_id, actions, now=int(time.time()))
    finally:
        store.close()
    if added is None:
        raise CliError(f"no active credential with id {args.credential_id!r}")
    if added:
        print(f"granted {args.credential_id}: {', '.join(added)}", file=sys.stderr)
    else:
        print(f"{args.credential_id} already held every one of those actions", file=sys.stderr)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from daemon.state.sessions import CREDENTIAL_ID_RE

    if CREDENTIAL_ID_RE.fullmatch(args.credential_id) is None:
        # Not echoed: an operator who pastes a token here must not see it printed back.
        raise UsageError("ID: expected a credential id (cred_ followed by 16 hex characters)")
    store = _store(args)
    try:
        revoked = store.revoke(args.credential_id, now=int(time.time()))
    finally:
        store.close()
    if not revoked:
        raise CliError(f"no active credential with id {args.credential_id!r}")
    print(f"revoked {args.credential_id}", file=sys.stderr)
    return 0
