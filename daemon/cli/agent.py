"""`buzz-broker agent import|create|name|list|remove|forget`: the operator's side of the keystore
and of the public directory (daemon/state/directory.py).

Rules:
- `import` reads the agent's secret (64 hex digits or `nsec1…`) from stdin, straight into
  a buffer zeroed on every path (by custody, and here if custody never got it); never from
  argv or the environment. On a terminal the prompt goes to stderr and echo is off. It prints the agent's
  pubkey hex, alone, on stdout.
- `create` mints a new key for `--owner` and prints its pubkey alone on stdout; when the
  owner is a person (not held here), stderr says exactly what the owner must sign.
- A name is the directory's, never custody's: `create --name` and `import --name` seal the
  key first, print its pubkey, and then write the name, so a fault or Ctrl-C there never
  leaves a key held whose pubkey was not printed (tests/cli/test_operator_mistakes.py::
  test_ctrl_c_during_the_name_write_leaves_no_key_whose_pubkey_was_not_printed). An agent
  imported without a name is listed under the first 12 hex digits of its pubkey; `name PUBKEY NAME` sets it later. The name is this
  host's only: nothing is published (agents.update renames a managed agent on the relay).
  A name is checked before a key is made or a secret read (`_checked_name`): 1 to 256
  characters the directory can store (no argv byte that is not UTF-8) and one line by the
  contract's name rule; refused, it is one line, exit 2 (a malformed argument, as every
  other: `UsageError`, daemon/cli/_common.py), and no key is made
  (tests/cli/test_operator_mistakes.py::test_a_name_that_cannot_be_kept_is_refused_before_a_key_is_made).
- `attach-auth` stores an owner-signed NIP-OA tag after creation (daemon/cli/agent_auth.py).
- `list` prints public records (table, or `--json`: one JSON object per line, the
  convention of every `--json`); it needs no token.
  A name is whatever a store holds (an agent's agents.create, a restored backup, a
  directory written by hand), so it is printed through `printable` / `print_json_line`:
  no control, line separator or bidi override reaches the terminal raw.
  A live agent without a NIP-OA tag shows `NO-AUTH-TAG` (`"authTagMissing": true`).
- `import` refuses an ownership cycle (the agent already owns `--owner`, directly or
  through its agents): custody checks it where the agent's pubkey is first known.
- `remove PUBKEY` destroys the sealed key (the public record stays as a tombstone), drops
  what the daemon keeps of keys that are gone, as the daemon does after a destroy
  (daemon/state/leftovers.py), and revokes every credential of the agent; the running daemon
  refuses them from its next request (it also refuses any credential whose agent is not
  live, however it was removed). It asks for confirmation — the word `yes` on stdin,
  prompted on stderr — unless `--yes` is given. Running it again on a removed agent revokes
  what is left. Its question and its result line say what becomes of the key (`_KEY_FATES`):
  in-process custody destroys it for good; a custodian keeps a sealed copy for its grace
  period, which its `--recover` brings back and its `--forget-destroyed PUBKEY` deletes now
  (tests/custodian/test_commands.py::test_agent_remove_says_the_custodian_keeps_a_copy_and_how_to_end_it).
- `forget PUBKEY ...` (custody in the daemon; with a custodian, exit 2 naming its
  `--forget-destroyed`) drops the records of the removed agents named, so new ones fit
  under `[custody] max_records` again, and then, at once, what the daemon keeps of them
  (names, watermarks, runtimes: `leftovers.forget`, a name written in the last minute
  too, so a re-import takes its new `--name`: tests/adversarial/test_record_bound.py::
  test_forget_then_reimport_takes_the_new_name): all of them or none, never a live one
  nor one a kept record names as owner (custody/_forget.py). What it gives up is said:
  the host no longer refuses those keys as removed ones. It is recorded in the key-event
  log (daemon/cli/_key_trail.py: event `forget`; done: the records that went; failed: the
  refusal's line), as the custodian's `--forget-destroyed` is in its own log
  (tests/adversarial/test_record_bound.py::test_agent_forget_is_recorded_in_the_key_event_log).
- `import-names` reads on stdin the names file a custodian's `keys restore --names-out`
  wrote (at most `MAX_NAMES_BYTES`: a `{"restore": {"file", "sha256"}}` line, then one
  `{"pubkey", "name", "creator", "restored"}` a backup agent; custody/custodian/keys.py),
  records the custodian's restore in the key-event log (daemon/cli/_key_trail.py: event
  `custodian-restore`, the backup's path and sha256; done: the agents the file says were
  restored that the custodian holds live, and how many of the others it holds), then
  writes each live agent's name into the directory as `keys restore` does
  (`enroll_restored`: a name already set is kept, a bad entry is said and skipped). The
  file crossed from another uid: every line is checked, a malformed one refuses the whole
  input before anything is recorded or written; a pubkey the custodian does not hold live
  is said and neither recorded nor named. The line says what the custodian's file claims,
  checked only against its live records: its own log is the restore's witness.
- Faults are one CliError line naming the fault; no secret ever reaches output.

WARNING: README.md ("The command line") and docs/install.md (step 6) show these
subcommands and flags; keep them in step with `add_arguments`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import termios
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import trio

from buzzwire.contract import printable, scrub_line
from daemon.cli import agent_auth
from daemon.cli._common import (CliError, UsageError, agent_directory, config_from_args,
                                open_keys, print_json_line)

if TYPE_CHECKING:
    from custody import Custody, KeyRecord
    from daemon.config import Config
    from daemon.state.directory import AgentDirectory
    from daemon.state.leftovers import Pruned
    from daemon.state.runtimes import RuntimeStore
    from daemon.state.sign_watermarks import SignWatermarks

    #: What `_on_leftovers` hands its action: the stores of what the daemon keeps per key.
    _Stores = tuple[AgentDirectory, SignWatermarks, RuntimeStore]

# A command has no operator log: `_prune_leftovers` says a refused prune in its own line,
# not through logging's last resort.
logging.getLogger("buzz_broker.leftovers").addHandler(logging.NullHandler())

HELP = "import, create, list, remove agents held in custody, and attach owners' NIP-OA tags"

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="agent_command", metavar="SUBCOMMAND")
    sub.required = True

    p = sub.add_parser("import", help="seal an existing agent key read from stdin")
    p.add_argument("--owner", required=True, metavar="HEX", help="the owner's pubkey (64 hex)")
    p.add_argument("--name", default=None, help="a name for the agent (default: the first 12 hex of its pubkey)")
    p.add_argument(
        "--auth-tag",
        default=None,
        metavar="JSON",
        help='the owner\'s NIP-OA tag, e.g. \'["auth","<owner>","","<sig>"]\' (verified)',
    )

    p = sub.add_parser("create", help="mint a new agent key for an owner")
    p.add_argument("--owner", required=True, metavar="HEX", help="the owner's pubkey (64 hex)")
    p.add_argument("--name", required=True, help="a name for the agent")

    p = sub.add_parser("name", help="set the name this host lists an agent under (not "
                       "published; agents.update renames a managed agent on the relay)")
    p.add_argument("pubkey", metavar="PUBKEY")
    p.add_argument("name", metavar="NAME")

    p = sub.add_parser("list", help="list agents (public records only)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--all", action="store_true", help="include removed agents (tombstones)")

    p = sub.add_parser(
        "remove", help="destroy an agent's sealed key and revoke its credentials (tombstone kept)"
    )
    p.add_argument("pubkey", metavar="PUBKEY")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    sub.add_parser("import-names", help="write into the directory the names a custodian's "
                   "`keys restore --names-out` wrote (the file on stdin)")

    p = sub.add_parser("forget", help="drop removed agents' records, named (custody in the "
                       "daemon): the way back under [custody] max_records")
    p.add_argument("pubkey", metavar="PUBKEY", nargs="+")

    agent_auth.add_arguments(sub)


def _pubkey(value: str, what: str) -> str:
    from buzzwire.nostr import is_hex64

    if not is_hex64(value):
        raise UsageError(f"{what} must be 64 lowercase hex characters")
    return value


def _owner(value: str) -> str:
    """`--owner`: a pubkey that is a curve point. Custody refuses any other too (it signs
    the owner's NIP-OA tag and is its NIP-AE peer), but that was exit 1 after custody
    opened; a value that is no key is the command line's fault, said before."""
    from buzzwire.contract import is_valid_pubkey

    if not is_valid_pubkey(_pubkey(value, "--owner")):
        raise UsageError(f"--owner: {value} is not a secp256k1 x-only public key (no curve "
                         "point has this x)")
    return value


def _with_custody(config: Config, action: Callable[[Custody], Awaitable[T]]) -> T:
    from custody import CustodyError

    async def main() -> T:
        # With a custodian, mint, import and destroy go through its table (docs/custodian.md).
        custody = await open_keys(config)
        try:
            return await action(custody)
        finally:
            await custody.aclose()

    try:
        return trio.run(main)
    except CustodyError as exc:
        raise CliError(str(exc)) from None


def _checked_name(name: str, flag: str) -> str:
    """`name` if the directory keeps it and it is a name an agent could have chosen;
    checked before a key is made or a secret read, so a refused name leaves no key behind
    without its pubkey printed.

    The character rule is the contract's for names (`TextKind.LINE`, which agents.create
    applies; `scrub_line` changes exactly the characters it refuses), not credential labels'
    `str.isprintable()`: that would also refuse the ZWJ and ZWNJ that emoji sequences and
    Persian or Indic names need, which an agent's own name may hold.
    """
    from daemon.state.directory import check_name

    try:
        check_name(name)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if scrub_line(name) != name:
        raise UsageError(f"{flag}: name must be one line, without control, line-separator "
                         "or bidi-control characters")
    return name


def _import(args: argparse.Namespace, config: Config) -> int:
    owner = _owner(args.owner)
    if args.name is not None:
        _checked_name(args.name, "--name")
    auth_tag = None if args.auth_tag is None else agent_auth.parse_tag(args.auth_tag, "--auth-tag")
    from custody import CustodyError

    try:
        secret_text = _read_secret(sys.stdin.fileno())
    except CustodyError as exc:
        raise CliError(str(exc)) from None
    try:
        record: KeyRecord = _with_custody(
            config, lambda c: c.import_agent(secret_text, owner=owner, auth_tag=auth_tag))
    finally:
        # import_agent zeroes it on every path, but custody may refuse before that call
        # (wrong PIN, no KEK, unreadable keystore): zero it here too.
        secret_text[:] = bytes(len(secret_text))
    # The pubkey first: whatever stops the name's write (a fault, a Ctrl-C), the key held
    # is never one the operator was not shown.
    print(record.pubkey, flush=True)
    if args.name is not None:
        _enroll(config, record.pubkey, args.name)
    return 0


def _enroll(config: Config, pubkey: str, name: str) -> None:
    """Write the agent's name into the directory (custody holds no names)."""
    with agent_directory(config, f"{pubkey} is held, but its name was not stored "
                         f"({{}}); name it with: buzz-broker agent name {pubkey} NAME") as d:
        d.enroll(pubkey, name)


def _name(args: argparse.Namespace, config: Config) -> int:
    pubkey = _pubkey(args.pubkey, "PUBKEY")
    name = _checked_name(args.name, "NAME")
    with agent_directory(config) as directory:
        record = directory.rename(pubkey, name)
    if record is None:
        raise CliError(f"no live agent {pubkey} is held here")
    print(f"{record.pubkey} is named '{printable(record.name)}' on this host (not published)",
          file=sys.stderr)
    return 0


def _read_secret(fd: int) -> bytearray:
    """The secret text from `fd`; on a terminal, prompted on stderr and not echoed.

    Echo is turned off with termios (ECHO cleared; canonical mode kept, so the operator can
    still edit the line) and restored in `finally`, whatever ends the read (Ctrl-C too).
    """
    from custody import read_secret_text

    if not os.isatty(fd):
        return read_secret_text(fd)
    print("agent secret (64 hex or nsec1…), not echoed; then Enter and Ctrl-D:",
          file=sys.stderr, flush=True)
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        return read_secret_text(fd)  # a tty that refuses termios: nothing to turn off
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflags
    termios.tcsetattr(fd, termios.TCSAFLUSH, quiet)
    try:
        return read_secret_text(fd)
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)
        print(file=sys.stderr, flush=True)  # the Enter the terminal did not echo


def _create(args: argparse.Namespace, config: Config) -> int:
    owner = _owner(args.owner)
    _checked_name(args.name, "--name")
    record: KeyRecord = _with_custody(config, lambda c: c.mint_agent(owner=owner))
    print(record.pubkey, flush=True)  # before the name's write, as in `_import`
    _enroll(config, record.pubkey, args.name)
    if record.auth_tag is None:
        print(agent_auth.request_text(record.pubkey, record.owner), file=sys.stderr)
    return 0


def _list(args: argparse.Namespace, config: Config) -> int:
    with agent_directory(config) as directory:
        records = directory.agents(include_deleted=args.all)
    if args.json:
        # `authTagMissing`: a live agent whose owner (a person) has not signed its NIP-OA tag.
        for r in records:
            print_json_line({**r.to_json_obj(), "authTagMissing": r.live and r.auth_tag is None})
        return 0
    for r in records:
        state = "removed" if r.deleted_at is not None else "live"
        tag = "auth-tag" if r.auth_tag else ("NO-AUTH-TAG" if r.live else "-")
        print(f"{r.pubkey}  owner={r.owner}  depth={r.depth}  {tag}  {state}  {printable(r.name)}")
    return 0


#: What `agent remove` must read on stdin to go ahead without `--yes`.
CONFIRM_WORD = "yes"


@dataclass(frozen=True, slots=True)
class _KeyFate:
    """What `agent remove` does to the key, said in its question and again in its result
    line: the operator decides on it, so it must be the truth for who holds the keys."""

    #: the question's clause, after "remove agent PUBKEY: "
    asked: str
    #: the result line's last clause, after "removed PUBKEY (tombstone kept); revoked N
    #: credential(s); "
    done: str


#: Is a custodian set (`[custody] custodian_socket`)? -> what removing a key does to it
#: (docs/operations.md, "Removing an agent ends its authority"). In-process custody deletes the sealed
#: blob (a tombstone stays, and a restore refuses the key here: custody/_restore.py). A
#: custodian keeps a sealed copy for its grace period first (custody/custodian/grace.py),
#: which its `--recover` brings back; its length, `destroy_grace_seconds`, is in the
#: custodian's own file, and no row of its table tells the daemon, so none is quoted here.
#: `--forget-destroyed PUBKEY` deletes that copy at once (docs/custodian.md).
_KEY_FATES: dict[bool, _KeyFate] = {
    False: _KeyFate(asked="its key is destroyed for good and its credentials revoked",
                    done="its key is destroyed for good"),
    True: _KeyFate(
        asked="its credentials are revoked and the custodian destroys its key, but keeps a "
              "sealed copy for its grace period (destroy_grace_seconds in the custodian's "
              "file), from which the custodian's --recover {pubkey} brings it back; to "
              "destroy that copy now: {forget}",
        done="the custodian keeps a sealed copy of its key for its grace period "
             "(recoverable with its --recover {pubkey}); to destroy the copy now: {forget}"),
}
#: The custodian's command that deletes a destroyed key's copy (its installed wrapper, then
#: the command it runs: docs/custodian.md, "--forget-destroyed PUBKEY ...").
_FORGET = ("buzz-custodian-admin --forget-destroyed {pubkey} "
           "(buzz-broker custodian FILE --forget-destroyed {pubkey})")


def _key_fate(config: Config, pubkey: str) -> _KeyFate:
    fate = _KEY_FATES[bool(config.custody.custodian_socket)]
    forget = _FORGET.format(pubkey=pubkey)
    return _KeyFate(asked=fate.asked.format(pubkey=pubkey, forget=forget),
                    done=fate.done.format(pubkey=pubkey, forget=forget))


def _confirmed(pubkey: str, fate: _KeyFate) -> bool:
    print(f"remove agent {pubkey}: {fate.asked}. Type {CONFIRM_WORD!r} to go on:",
          file=sys.stderr, flush=True)
    # One short line is all that is read: stdin may be anything.
    answer = sys.stdin.readline(len(CONFIRM_WORD) + 2)
    return answer.strip() == CONFIRM_WORD


def _remove(args: argparse.Namespace, config: Config) -> int:
    from daemon.state.sessions import SessionStore

    pubkey = _pubkey(args.pubkey, "PUBKEY")
    fate = _key_fate(config, pubkey)
    if not args.yes and not _confirmed(pubkey, fate):
        raise CliError("not confirmed; nothing removed (pass --yes to skip the question)")
    record: KeyRecord = _with_custody(config, lambda c: c.destroy_agent(pubkey))
    _prune_leftovers(config)
    try:
        store = SessionStore.open(Path(config.state.dir))
        try:
            revoked = store.revoke_agent(pubkey)
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - one line for the operator, not a traceback
        # The daemon refuses a removed agent's credentials anyway (liveness at
        # authentication); running `agent remove` again revokes them.
        raise CliError(
            f"removed {record.pubkey}, but its credentials could not be revoked: "
            f"{type(exc).__name__}; run agent remove again"
        ) from None
    print(f"removed {record.pubkey} (tombstone kept); revoked {revoked} credential(s); "
          f"{fate.done}", file=sys.stderr)
    return 0


#: What the daemon keeps of a key, and the command that drops some -> what a fault says
#: (the daemon's next destroy or start prunes what stays).
_LEFTOVERS_STAY = {
    "prune": "what the daemon keeps of removed keys stays for now",
    "forget": "what the daemon keeps of the keys forgotten stays for now",
}


def _prune_leftovers(config: Config) -> None:
    """After a destroy, as the daemon does: what it keeps of keys that are gone goes
    (daemon/state/leftovers.py). A fault is one line: the daemon prunes after its next
    destroy or at its next start; so is a key source that holds none of the agents the
    stores keep (its log line is the daemon's: a command has no operator log)."""
    from daemon.state import leftovers

    pruned = _on_leftovers(config, "prune", lambda stores: leftovers.prune(
        *stores, custodian=bool(config.custody.custodian_socket)))
    if pruned is not None and pruned.unmatched:
        print(f"{leftovers.UNMATCHED} ({leftovers.UNMATCHED_FIX})", file=sys.stderr)


def _forget_leftovers(config: Config, gone: list[str]) -> None:
    """After `agent forget`: what the daemon keeps of exactly the keys forgotten goes now
    (`leftovers.forget`), a name written in the last minute too, so an import of one
    takes the name it is given (enroll keeps a name already set)."""
    from daemon.state import leftovers

    _on_leftovers(config, "forget", lambda stores: leftovers.forget(*stores, gone))


def _on_leftovers(config: Config, command: str,
                  run: Callable[[_Stores], Pruned]) -> Pruned | None:
    """`run` on the directory, watermarks and runtimes of the state directory; None, and
    one line (`_LEFTOVERS_STAY`), if a store could not be opened, read or written."""
    import sqlite3
    from contextlib import closing

    from daemon.state.runtimes import RuntimeStore
    from daemon.state.sign_watermarks import SignWatermarks

    state_dir = Path(config.state.dir)
    try:
        with agent_directory(config) as directory, \
                closing(SignWatermarks.open(state_dir)) as watermarks, \
                closing(RuntimeStore.open(state_dir)) as runtimes:
            return run((directory, watermarks, runtimes))
    except (OSError, sqlite3.Error, CliError) as exc:
        print(f"{_LEFTOVERS_STAY[command]} ({type(exc).__name__}); the daemon drops it after "
              "its next destroy or at its next start", file=sys.stderr)
        return None


#: A names file of 100,000 agents is about 20 MB; more is refused unread.
MAX_NAMES_BYTES = 32 * 1024 * 1024
#: The members of the names file's first line's `restore` object, and of each later line.
_NAMES_HEADER = frozenset({"file", "sha256"})
_NAMES_ENTRY = frozenset({"pubkey", "name", "creator", "restored"})


@dataclass(frozen=True, slots=True)
class _NamesFile:
    """A custodian restore's `--names-out` file, every line checked."""

    file: str
    sha256: str
    #: pubkey -> its public entry (name, creator) and whether the restore sealed it
    entries: dict[str, dict[str, object]]


def _names_line(line: bytes, number: int) -> object:
    import json

    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise CliError(f"names line {number} is not JSON; nothing written") from None


def _read_names(data: bytes) -> _NamesFile:
    """Check the whole file before anything is written: it crossed from another uid."""
    from buzzwire.nostr import is_hex64

    lines = data.splitlines()
    header = _names_line(lines[0], 1) if lines else None
    restore = header.get("restore") if isinstance(header, dict) and len(header) == 1 else None
    if not (isinstance(restore, dict) and set(restore) == _NAMES_HEADER
            and isinstance(restore["file"], str) and restore["file"]
            and isinstance(restore["sha256"], str) and is_hex64(restore["sha256"])):
        raise CliError('names line 1 is not {"restore": {file, sha256}} (a custodian\'s '
                       "keys restore --names-out writes it); nothing written")
    entries: dict[str, dict[str, object]] = {}
    for number, line in enumerate(lines[1:], 2):
        entry = _names_line(line, number)
        if not (isinstance(entry, dict) and set(entry) == _NAMES_ENTRY
                and is_hex64(entry["pubkey"]) and isinstance(entry["restored"], bool)):
            raise CliError(f"names line {number} is not {{pubkey, name, creator, restored}}; "
                           "nothing written")
        entries[entry["pubkey"]] = entry
    return _NamesFile(restore["file"], restore["sha256"], entries)


def _import_names(args: argparse.Namespace, config: Config) -> int:
    from daemon.cli._key_trail import clip, recorded
    from daemon.cli.keys_backup import enroll_restored
    from daemon.state.audit import KeyAction

    data = sys.stdin.buffer.read(MAX_NAMES_BYTES + 1)
    if len(data) > MAX_NAMES_BYTES:
        raise CliError(f"the names file is larger than {MAX_NAMES_BYTES} bytes")
    names = _read_names(data)
    with agent_directory(config) as directory:
        live = {r.pubkey for r in directory.agents()}
    for pubkey in (p for p in names.entries if p not in live):
        print(f"{pubkey}: no live agent held here; not recorded, its name not written",
              file=sys.stderr)
    held_here = {p: e for p, e in names.entries.items() if p in live}
    restored = tuple(p for p, e in held_here.items() if e["restored"])
    # The keys were sealed by the custodian already: the intent names the backup this
    # step records, the outcome what the custodian's records now hold of it. Recorded
    # before the names, as `keys restore` does: the keys are held whatever the names do.
    with recorded(Path(config.state.dir), KeyAction.CUSTODIAN_RESTORE,
                  file=clip(names.file), sha256=names.sha256) as trail:
        trail.done(agents=len(restored), pubkeys=restored,
                   held=len(held_here) - len(restored))
    enroll_restored(config, {p: e for p, e in held_here.items() if isinstance(e["name"], str)})
    print(f"names read for {len(names.entries)} agents; {len(held_here)} held here "
          f"({len(restored)} restored by the custodian, recorded in the key-event log; "
          "a name already set is kept)", file=sys.stderr)
    return 0


#: What `agent forget` says where a custodian holds the keys: its records are its own.
_FORGET_WITH_CUSTODIAN = ("with a custodian ([custody] custodian_socket) its records are "
                          "forgotten under its uid: buzz-custodian-admin --forget-destroyed "
                          "PUBKEY ... (buzz-broker custodian FILE --forget-destroyed PUBKEY ...)")


def _forget(args: argparse.Namespace, config: Config) -> int:
    """Drop the records of removed agents named, so new ones fit under [custody]
    max_records again (custody/_forget.py: never a live one, never a kept record's owner;
    all of them or none). What it gives up is said: the host no longer refuses those keys
    as removed ones."""
    from buzzwire.nostr import is_hex64
    from custody import CustodyError, NotForgotten, forget_removed
    from daemon.cli._key_trail import recorded
    from daemon.state.audit import KeyAction

    if config.custody.custodian_socket:
        raise UsageError(_FORGET_WITH_CUSTODIAN)
    for number, text in enumerate(args.pubkey, 1):
        if not is_hex64(text):  # never echoed: a secret key pasted by mistake is hex too
            raise UsageError(f"key {number} named is not a pubkey (64 lowercase hex); not "
                             "shown; nothing was forgotten")
    # Recorded as `keys restore` is (daemon/cli/_key_trail.py): the intent before any record
    # goes, the outcome naming those that went, or the refusal's one line. The custodian's
    # `--forget-destroyed` writes its own signed log instead.
    with recorded(Path(config.state.dir), KeyAction.FORGET) as trail:
        try:
            gone = forget_removed(Path(config.state.dir), args.pubkey)
        except NotForgotten as exc:
            for pubkey, why in exc.stays.items():
                # A key with no record here may be a secret pasted by mistake (64 hex
                # too): said by its place among those named, never by its value.
                who = pubkey if why != "unknown" else \
                    f"key {args.pubkey.index(pubkey) + 1} named (not shown)"
                print(f"{who}: not forgotten: {exc.why(pubkey)}", file=sys.stderr)
            raise CliError(str(exc)) from None
        except CustodyError as exc:
            raise CliError(str(exc)) from None
        trail.done(agents=len(gone), pubkeys=gone)
    _forget_leftovers(config, gone)
    print(f"forgot {len(gone)} removed agents' records: this host no longer refuses those "
          "keys as removed ones (an import or a restore of one is taken)", file=sys.stderr)
    return 0


_SUBCOMMANDS: dict[str, Callable[[argparse.Namespace, "Config"], int]] = {
    "import": _import,
    "create": _create,
    "name": _name,
    "list": _list,
    "remove": _remove,
    "attach-auth": agent_auth.attach,
    "import-names": _import_names,
    "forget": _forget,
}


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    return _SUBCOMMANDS[args.agent_command](args, config)
