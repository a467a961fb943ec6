"""`buzz-broker audit verify|show|reanchor`: check the audit chain, read it, re-anchor it.

Rules:
- `verify [PATH] [--head SEQ:HASH | --ends-at HASH]` checks the hash chain of an audit
  directory or of one file. It prints `ok N records; head SEQ:HASH` and exits 0, or prints
  the first broken record
  (`broken: FILE line N: reason`) and exits `EXIT_BROKEN`. Without PATH it checks the
  configured `<state.dir>/audit`, then the key-event log `<state.dir>/key-events` against
  its anchor `key-events.head` (daemon/state/key_events.py) when either exists, each line
  prefixed `audit log: ` or `key-event log: `; it exits `EXIT_BROKEN` if either is broken.
  A plain `key-events.jsonl` from an earlier version is noted, never read as a chain.
  `--head SEQ:HASH` is a head remembered from the operator log (`audit.head`'s seq and
  head) or an earlier `verify`: the log must still hold record SEQ with that hash, and the
  whole chain verifies from the start through it and on to the end (a log that has only
  grown passes). `--ends-at HASH` is stricter: the log must end at that hash, nothing added
  since. Either applies to the audit log (or PATH), not the key-event log. Without PATH the
  audit log must also reach the anchor the state database holds
  (`<state>/ledger.db`); a missing log with an anchor, or with `--head`/`--ends-at`, is
  broken too. `--archived`: the
  oldest files were moved away (docs/operations.md, "Retention and archiving").
  A PATH that is not an audit log by name (a directory without `audit-NNNNNN.jsonl`
  files, a file of another name such as the custodian's `signed.jsonl`) is a fault,
  exit 1, never a verdict (`_given_log`).
- `reanchor [--yes]` is for an operator who restored a disk from an older backup: the log
  (which must verify on its own) is accepted as it is. It writes a `reanchor` record
  naming the anchor given up, then anchors the new head. It asks first unless `--yes`,
  refuses without a terminal, and refuses while the daemon holds the log.
- `show` prints records filtered by `--agent`, `--credential`, `--action`, `--since`,
  `--until` as a table, or with `--json` the stored lines themselves (canonical JSON, one
  per line). TIME is ISO-8601 (`2026-11-30`, `2026-11-30T15:00:00Z`; no zone = UTC) or
  relative to now (`90s`, `30m`, `1h`, `7d`). `show` does not check the chain — `verify`
  does — but marks any line it cannot read (on stderr).
- The audit log holds no secrets, so everything in it may be printed.
- Faults (missing path, unreadable file) are one-line CliErrors; a malformed filter
  (`--since`/`--until` TIME, `--agent`, a `--credential` not of the shape the daemon issues,
  an `--action` not in the contract's ACTIONS) a UsageError, exit 2, checked before any path.

WARNING: `EXIT_BROKEN`, the `ok …`/`broken: …` lines and the TIME grammar are documented in
docs/operations.md ("Verifying", "Reading"); keep them in step.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from pathlib import Path
from typing import Final

from buzzwire.contract import printable
from daemon.cli._common import CliError, UsageError, config_from_args

HELP = "verify the audit log's hash chain, or show its records"

#: Exit status when the chain is broken (1 is a fault, 2 a usage error).
EXIT_BROKEN: Final = 3

_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RELATIVE_RE: Final = re.compile(r"([0-9]{1,9})([smhd])")
_HEX64_RE: Final = re.compile(r"[0-9a-fA-F]{64}")
#: What an action name looks like (`channel.read`): an unknown one of this shape is echoed.
_ACTION_SHAPE: Final = re.compile(r"[a-z]{1,20}\.[a-z]{1,20}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_command", metavar="SUBCOMMAND")
    sub.required = True

    check = sub.add_parser("verify", help="check the hash chain; print the first broken record")
    check.add_argument("path", nargs="?", metavar="PATH",
                       help="audit directory or one audit file (default: <state>/audit)")
    remembered = check.add_mutually_exclusive_group()
    remembered.add_argument("--head", metavar="SEQ:HASH", type=_seq_and_hash,
                            help="a head remembered from before (audit.head's seq and head, or "
                                 "an earlier verify's): the log must still hold it and chain "
                                 "from it")
    remembered.add_argument("--ends-at", metavar="HASH", type=_hash,
                            help="the head hash the log must still end at (nothing added since)")
    check.add_argument("--archived", action="store_true",
                       help="the oldest files were archived: start at the first file present")
    check.set_defaults(_audit=_verify)

    again = sub.add_parser("reanchor", help="accept the log as it is after a restore from "
                                           "backup (writes a reanchor record)")
    again.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    again.set_defaults(_audit=_reanchor)

    show = sub.add_parser("show", help="show records as a table (filters combine)")
    show.add_argument("--agent", metavar="HEX", help="only this agent's records")
    show.add_argument("--credential", metavar="ID", help="only this credential's records")
    show.add_argument("--action", metavar="NAME", help="only this action")
    show.add_argument("--since", metavar="TIME", help="from TIME (ISO-8601, or 1h / 7d ago)")
    show.add_argument("--until", metavar="TIME", help="up to TIME (ISO-8601, or 1h / 7d ago)")
    show.add_argument("--json", action="store_true", help="the stored JSON lines")
    show.add_argument("--path", metavar="DIR", help="audit directory (default: <state>/audit)")
    show.set_defaults(_audit=_show)


def run(args: argparse.Namespace) -> int:
    code: int = args._audit(args)
    return code


def _audit_dir(args: argparse.Namespace, given: str | None) -> Path:
    from daemon.state.audit import AUDIT_DIRNAME

    if given:
        path = Path(given)
    else:
        path = Path(config_from_args(args).state.dir) / AUDIT_DIRNAME
    try:
        present = path.exists()
    except PermissionError:
        raise  # main's permission_denied names the state directory's user
    except OSError as exc:  # a name too long for the system, a component too deep
        raise CliError(f"cannot use {path}: {exc.strerror}") from None
    if not present:
        raise CliError(f"no audit log at {path}")
    return path


def parse_time(text: str, now: float) -> float:
    """`--since`/`--until`: ISO-8601 (UTC unless a zone is given) or `<n><s|m|h|d>` ago."""
    text = text.strip()
    match = _RELATIVE_RE.fullmatch(text)
    if match is not None:
        return now - int(match.group(1)) * _UNITS[match.group(2)]
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"bad time {text[:40]!r}: expected ISO-8601 (2026-11-30T15:00:00Z) or 30m, 1h, 7d"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _state_anchor(args: argparse.Namespace) -> tuple[Path, tuple[int, str] | None]:
    """The configured audit directory and the anchor its state database holds."""
    import sqlite3

    from daemon.state.audit import AUDIT_DIRNAME
    from daemon.state.ledger import LEDGER_FILENAME, read_anchor

    state = Path(config_from_args(args).state.dir)
    try:
        return state / AUDIT_DIRNAME, read_anchor(state / LEDGER_FILENAME)
    except sqlite3.Error as exc:
        raise CliError(f"cannot read the anchor in {state / LEDGER_FILENAME}: {exc}") from None


def _hash(text: str) -> str:
    if not _HEX64_RE.fullmatch(text):
        raise argparse.ArgumentTypeError("expected a 64-hex sha256")
    return text.lower()


def _seq_and_hash(text: str) -> tuple[int, str]:
    """`SEQ:HASH` as `verify` prints a head and `audit.head` logs one (seq=, head=)."""
    seq, colon, digest = text.partition(":")
    if not colon or not seq.isascii() or not seq.isdigit() or not _HEX64_RE.fullmatch(digest):
        raise argparse.ArgumentTypeError(
            "expected SEQ:HASH (a record number and its 64-hex sha256, as `verify` prints "
            "the head); for a bare hash the log must end at, use --ends-at")
    return int(seq), digest.lower()


#: Said when PATH holds no log of the daemon's: where the other log an operator may point it
#: at, the custodian's (`<log_dir>/signed.jsonl`, another chain in another format), is
#: verified instead (docs/custodian.md).
_CUSTODIANS_LOG: Final = ("the custodian's log (signed.jsonl) is verified by its own command: "
                          "buzz-broker custodian FILE --verify-log")


def _given_log(args: argparse.Namespace) -> Path:
    """PATH, if it is an audit log by name: a directory holding audit files, or one of them.

    Refused (a fault, exit 1), not verified: a directory with none (an empty or failed
    archive copy, the state directory itself) verified as "ok 0 records", a pass for a
    copy that holds nothing; a file of another name (the custodian's log) was read as
    audit records and reported "broken ... (the line was edited)", a false tamper alarm.
    Without PATH an empty `<state>/audit` stays "ok 0 records": the state's anchor is what
    says whether records are missing there.
    """
    from daemon.state.audit import audit_files, is_audit_file_name

    path = _audit_dir(args, args.path)
    try:
        if path.is_dir() and not path.is_symlink() and not audit_files(path):
            raise CliError(f"no audit files (audit-NNNNNN.jsonl) in {path}: nothing verified; "
                           f"give the audit directory itself (<state>/audit, "
                           f"<state>/key-events) or one of its files; {_CUSTODIANS_LOG}")
    except PermissionError:
        raise  # main's permission_denied names the state directory's user
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    if path.is_file() and not is_audit_file_name(path.name):
        raise CliError(f"{path} is not an audit file by its name (audit-NNNNNN.jsonl): not "
                       f"verified; {_CUSTODIANS_LOG}")
    return path


def _verify(args: argparse.Namespace) -> int:
    """PATH: that one log, unlabelled. Else the audit log and the key-event log, labelled."""
    if args.path is not None:
        return _verify_one(_given_log(args), label="", anchor=None, head=args.head,
                           ends_at=args.ends_at, archived=args.archived)
    from daemon.state.key_events import HEAD_FILE, KEY_EVENTS_DIRNAME, LEGACY_FILE

    path, anchor = _state_anchor(args)
    keys = path.parent / KEY_EVENTS_DIRNAME
    has_keys = keys.exists() or keys.is_symlink() or (path.parent / HEAD_FILE).exists()
    if not path.exists() and anchor is not None and anchor[0] > 0:
        print(f"audit log: broken: {path} is missing, but the anchor is record {anchor[0]} "
              f"(the log was deleted)")
        code = EXIT_BROKEN
    elif not path.exists() and (args.head is not None or args.ends_at is not None):
        # A remembered head is the operator's evidence that the log existed: without the
        # log it cannot be held, whatever the rest of the state says.
        print(f"audit log: broken: {path} is missing, but it must hold the head given "
              f"(the log was deleted)")
        code = EXIT_BROKEN
    elif not path.exists() and has_keys:
        print(f"audit log: none at {path} (the daemon has not run here)")
        code = 0
    else:
        code = _verify_one(_audit_dir(args, str(path)), label="audit log: ", anchor=anchor,
                           head=args.head, ends_at=args.ends_at, archived=args.archived)
    code = max(code, _verify_key_events(path.parent))
    legacy = path.parent / LEGACY_FILE
    if legacy.exists():
        print(f"note: {legacy} holds plain, unchained key events from an earlier version; "
              "it is kept as it is and not verified (newer events are in the key-event log)")
    return code


def _verify_key_events(state: Path) -> int:
    """The key-event log, against its anchor (`key-events.head`); 0 when there is none."""
    from daemon.state.key_events import HEAD_FILE, KEY_EVENTS_DIRNAME, read_head

    keys = state / KEY_EVENTS_DIRNAME
    try:
        anchor = read_head(state)
    except ValueError as exc:
        print(f"key-event log: broken: {exc} (the anchor was damaged or edited)")
        return EXIT_BROKEN
    except OSError as exc:
        raise CliError(f"cannot read {state / HEAD_FILE}: {exc.strerror}") from None
    if not (keys.exists() or keys.is_symlink()):
        if anchor is None or anchor[0] == 0:
            return 0
        print(f"key-event log: broken: {keys} is missing, but its anchor is record "
              f"{anchor[0]} (the log was deleted)")
        return EXIT_BROKEN
    if keys.is_symlink() or not keys.is_dir():
        print(f"key-event log: broken: {keys} is not a directory")
        return EXIT_BROKEN
    # Never archived: key events are few; the chain is checked from its first record.
    return _verify_one(keys, label="key-event log: ", anchor=anchor, head=None, ends_at=None,
                       archived=False)


def _verify_one(path: Path, *, label: str, anchor: tuple[int, str] | None,
                head: tuple[int, str] | None, ends_at: str | None, archived: bool) -> int:
    """Verify one chain directory (or file); print its lines, prefixed with `label`."""
    from daemon.state.audit import verify

    if path.is_symlink() or not (path.is_dir() or path.is_file()):
        print(f"{label}broken: {path} is not a directory of audit files")
        return EXIT_BROKEN
    try:
        result = verify(path, expect_head=ends_at, anchor=anchor, contains=head,
                        archived=archived)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    if result.ok:
        print(f"{label}ok {result.records} records; head {result.seq}:{result.head}")
        if anchor is not None:
            print(f"{label}reaches the anchored record {anchor[0]}")
        if head is not None:
            print(f"{label}holds the head given (record {head[0]}) and chains on from it")
        if result.torn_tail:
            print(f"{label}note: the last file ends in a partial line (a crash mid-write; it "
                  "was never acknowledged and the next writer drops it when it opens the log)")
        return 0
    where = f"{Path(result.file).name} line {result.line}: " if result.file else ""
    if result.file and result.line is None:
        where = f"{Path(result.file).name}: "
    print(f"{label}broken: {where}{result.reason} ({result.records} records verified before it)")
    return EXIT_BROKEN


def _reanchor(args: argparse.Namespace) -> int:
    import os

    import trio

    from daemon.state.audit import GENESIS, AuditLog, AuditUnavailable, Reanchor, verify
    from daemon.state.ledger import LEDGER_FILENAME, write_anchor

    path, anchor = _state_anchor(args)
    if anchor is None:
        print("no anchor is recorded: nothing to re-anchor (serve adopts the log's head)")
        return 0
    if path.exists():
        try:
            own = verify(path, archived=True)
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc.strerror}") from None
        if not own.ok:
            raise CliError(
                f"the audit log itself is broken ({own.reason}); move {path} aside (keep it "
                "as evidence) and run this again to start a new chain")
        if verify(path, anchor=anchor, archived=True).ok:
            print(f"the log reaches its anchor (record {anchor[0]}): nothing to do")
            return 0
        records, head = own.records, own.head
    else:
        records, head = 0, GENESIS
    print(f"The audit log ends at record {records} (head {head}),\n"
          f"but the anchor is record {anchor[0]} (head {anchor[1]}).\n"
          "Re-anchoring accepts the log as it is: whatever came after its end is given up.\n"
          "A reanchor record naming the old anchor is added to the log.")
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError("re-anchoring needs confirmation: run it in a terminal, or pass --yes")
        if input("Re-anchor? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not re-anchored")
            return 1

    async def write() -> tuple[int, str]:
        log = AuditLog.open(path)
        try:
            await log.append(Reanchor(at=time.time(), anchored_seq=anchor[0],
                                      anchored_head=anchor[1], uid=os.getuid()))
        finally:
            await log.aclose()
        return log.head

    try:
        new_head = trio.run(write)
    except AuditUnavailable as exc:
        raise CliError(f"cannot write the audit log: {exc.detail or exc} (is the daemon "
                       "running? stop it first)") from None
    write_anchor(path.parent / LEDGER_FILENAME, new_head)
    print(f"re-anchored at record {new_head[0]} (head {new_head[1]})")
    return 0


def _show(args: argparse.Namespace) -> int:
    from buzzwire.contract import ACTIONS
    from daemon.state.audit import read_records
    from daemon.state.sessions import CREDENTIAL_ID_RE

    # The filters first: a malformed one is the command line's fault, said before any path.
    now = time.time()
    since = parse_time(args.since, now) if args.since else None
    until = parse_time(args.until, now) if args.until else None
    agent = None
    if args.agent is not None:
        if not _HEX64_RE.fullmatch(args.agent):
            raise UsageError("--agent: expected 64 hex characters")
        agent = args.agent.lower()
    # Checked, not just compared: a typo matched nothing and read as "no such records".
    if args.credential is not None and not CREDENTIAL_ID_RE.fullmatch(args.credential):
        # Not echoed: an operator who pastes a token here must not see it printed back.
        raise UsageError("--credential: expected a credential id (cred_ followed by 16 hex "
                         "characters)")
    if args.action is not None and args.action not in ACTIONS:
        # Echoed only in an action's shape: a token pasted here must not be printed back.
        said = repr(args.action) if _ACTION_SHAPE.fullmatch(args.action) else "(not shown)"
        raise UsageError(f"--action: unknown action {said}; expected one of "
                         f"{', '.join(sorted(ACTIONS))}")
    path = _audit_dir(args, args.path)
    if not path.is_dir():
        raise CliError(f"{path} is not a directory")
    rows: list[tuple[str, ...]] = []
    try:
        for entry in read_records(path):
            record = entry.record
            if record is None:
                print(f"audit: cannot read {entry.file} line {entry.line}; run `buzz-broker "
                      f"audit verify`", file=sys.stderr)
                continue
            if agent is not None and getattr(record, "agent", None) != agent:
                continue
            if args.credential is not None and getattr(record, "credential_id",
                                                       None) != args.credential:
                continue
            if args.action is not None and getattr(record, "action", None) != args.action:
                continue
            if since is not None and record.at < since:
                continue
            if until is not None and record.at > until:
                continue
            if args.json:
                print(entry.raw.decode("ascii"))
                continue
            rows.append(_row(record))
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None
    if not args.json:
        _print_table(rows)
    return 0


_HEADER: Final = ("TIME (UTC)", "PHASE", "AGENT", "CREDENTIAL", "ACTION", "REQUEST ID",
                  "STATUS", "CODE", "EVENTS")


def _row(record: object) -> tuple[str, ...]:
    from daemon.state.audit import AuditRecord, KeyEvent, ReadCount, Reanchor, RefusalCount

    if isinstance(record, KeyEvent):  # `show --path <state>/key-events`
        return (_when(record.at), f"key {record.stage.value}", "-", f"uid {record.uid}",
                f"keys.{record.action.value}", f"op {record.op}", "-", "-",
                f"{record.agents} agents" if record.agents is not None else "-")
    if isinstance(record, RefusalCount):
        return (_when(record.at), "refusals", record.agent[:16], record.credential_id,
                record.action or "-", f"{record.count} counted", "failed", record.code.value,
                "-")
    if isinstance(record, ReadCount):
        # The targets (channels, d tags) by their first 8 characters, with their counts;
        # `--json` has them whole.
        shown = ",".join(f"{t[:8]}:{n}" for t, n in record.targets[:_TARGETS_SHOWN])
        more = len(record.targets) - _TARGETS_SHOWN
        return (_when(record.at), "reads", record.agent[:16], record.credential_id,
                record.action, f"{record.count} counted since {_when(record.since)[11:]}",
                record.status.value, record.code.value if record.code else "-",
                (shown + (f",+{more} more" if more > 0 else "")) or "-")
    if isinstance(record, Reanchor):
        return (_when(record.at), "reanchor", "-", f"uid {record.uid}", "-",
                f"gave up record {record.anchored_seq}", "-", "-", "-")
    assert isinstance(record, AuditRecord)
    when = datetime.datetime.fromtimestamp(record.at, tz=datetime.timezone.utc)
    status = record.status.value if record.status else "-"
    if record.replayed:
        status += " (replay)"
    events = ",".join(e[:12] for e in record.events) or "-"
    return (
        when.strftime("%Y-%m-%d %H:%M:%S"),
        record.phase.value,
        record.agent[:16],
        record.credential_id,
        record.action or "-",
        record.request_id,
        status,
        record.code.value if record.code else "-",
        events,
    )


#: How many of a `reads` line's targets the table shows.
_TARGETS_SHOWN: Final = 4


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, tz=datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S")


def _print_table(rows: list[tuple[str, ...]]) -> None:
    if not rows:
        print("no matching records")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADER)]
    for line in (_HEADER, *rows):
        # The record's fields are shape-checked, and escaped anyway: one rule for all output.
        print("  ".join(printable(cell).ljust(w) for cell, w in zip(line, widths)).rstrip())
