"""`buzz-broker keys backup` and `keys restore`: every live agent to an offline age key and back.

Rules:
- backup: `--recipient age1…` (one or more) and `--out FILE`. An existing FILE is refused
  before anything is unsealed, and is never overwritten or followed. The age ciphertext
  (custody encrypts in memory: `custody.export_backup`) is written first to
  `.FILE.<random>.partial` beside FILE, created with O_EXCL and mode 0600 before anything
  is unsealed, then fsynced, linked to FILE once whole, and the directory fsynced
  (`write_synced`, shared with the custodian's backup row: custody/custodian/backup.py).
  On any fault the partial file is removed. A run killed midway (SIGKILL, the OOM killer,
  a power cut) leaves only its partial file and never a FILE; the next backup to FILE
  removes it and says so on stderr
  (tests/backup/test_backup.py::test_a_backup_killed_midway_leaves_nothing_under_its_name_and_the_rerun_writes_it).
  The partial's name is random, so a run that removes a leftover can never link another
  run's unfinished file to FILE: a run whose partial was removed fails and leaves nothing.
- restore: `--identity FILE` (an `age-keygen` identity, mode 0600 or stricter, never a
  symlink) and the backup file. Custody decrypts and checks every entry (secret derives
  its pubkey, NIP-OA tag verifies against its owner) before anything is shown; the command
  lists what it will import on stdout and asks on the terminal, or takes `--yes`. Without
  a terminal and without `--yes` it refuses. It refuses to overwrite a different agent.
- Recorded, intent first (daemon/cli/_key_trail.py, daemon/state/key_events.py): both
  write an intent line to the key-event log `<state dir>/key-events/` (the audit log's
  hash chain, in a directory of its own: the running daemon holds its audit directory)
  and fsync it BEFORE anything is unsealed (backup: before the file is created) or sealed
  (restore: before the backup is decrypted). If it cannot be written the command stops:
  one CliError line, exit 1, nothing unsealed, no file. After the work, one outcome line:
  `done` (backup: the file's sha256, the pubkeys; restore: the pubkeys sealed, how many
  were already held) or `failed` (the fault's one line). A backup whose outcome cannot be
  written removes its file. Lines hold the time, the operator's uid and user name, the
  file's path and sha256, the recipients (public keys), counts and pubkeys: never a
  secret, never the identity file. `buzz-broker audit verify` checks the chain and its
  anchor (`key-events.head`). Tests: tests/backup/test_key_events.py; what it does not
  prove: docs/install.md, "The key-event log".
- A malformed recipient is refused before anything is recorded or done.
- Names: custody holds none, so backup hands custody each live agent's directory entry
  (name, creator) to carry, and restore writes the restored agents' entries back into the
  directory (`AgentDirectory.enroll`; an entry that is not a valid name is skipped and
  said, the key is restored either way). Depth is derived again from the owners.
- With a custodian, restore is refused before it gets here (this uid opens neither the
  token nor the keystore; keys.py `CUSTODIAN_COMMANDS`, the one table of these refusals):
  `buzz-broker custodian FILE keys restore` restores under the custodian's uid
  (custody/custodian/keys.py) and writes the names to a file; `agent import-names` reads
  it into the directory through `enroll_restored` and records that restore in the
  key-event log (`custodian-restore`; daemon/cli/agent.py).
- What a backup does not hold: credentials and the ledger (docs/install.md, "Restore").
- With a custodian (`[custody] custodian_socket`), backup asks it (its `backup` row,
  custody/custodian/backup.py): the recipients and the directory are the custodian's own
  configuration (`[backup]` in its file), so `--recipient` and `--out` are refused; the
  directory's names go with the request, as above. The intent is recorded before the
  request; the outcome names the custodian's file, its sha256, the agents and the
  recipients it answered. The file is the custodian's (under its uid): copy it off the
  host from there.

WARNING: docs/install.md ("Back up", "Restore") shows these flags; keep them in step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from buzzwire.contract import printable_json
from daemon.cli._common import CliError, UsageError, agent_directory
from daemon.cli._key_trail import KeyTrail, clip, recorded
from daemon.state.audit import KeyAction

if TYPE_CHECKING:
    from custody import RestoreResult
    from daemon.config import Config

#: Answers that confirm a restore at the prompt.
_YES = frozenset({"y", "yes"})
#: A backup's partial file after its `.FILE.`: `secrets.token_hex(4)`, then `.partial`.
_PARTIAL = re.compile(r"[0-9a-f]{8}\.partial")


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "backup",
        help="write every live agent, encrypted to age recipients, to a new file",
    )
    p.add_argument("--recipient", action="append", metavar="AGE_RECIPIENT",
                   help="an age X25519 recipient (age1…); repeat for several (not with a "
                        "custodian: its own are used)")
    p.add_argument("--out", metavar="FILE", type=Path,
                   help="the backup file to create (must not exist; written 0600; not with "
                        "a custodian: it writes into its own directory)")
    p = sub.add_parser(
        "restore",
        help="seal every agent of a backup under this host's KEK",
    )
    p.add_argument("--identity", required=True, metavar="FILE", type=Path,
                   help="the age identity file (AGE-SECRET-KEY-1…) the backup was made for")
    p.add_argument("backup", metavar="BACKUP", type=Path)
    p.add_argument("--yes", action="store_true", help="restore without asking")


def _recipients(texts: list[str]) -> tuple[str, ...]:
    """The recipients as the key-event log names them; a malformed one stops the command
    before anything is recorded or done (custody checks each one's checksum again)."""
    from daemon.state.audit import AGE_RECIPIENT_RE, MAX_KEY_RECIPIENTS

    if len(texts) > MAX_KEY_RECIPIENTS:
        raise UsageError(f"at most {MAX_KEY_RECIPIENTS} recipients")
    recipients = tuple(text.strip() for text in texts)
    for number, text in enumerate(recipients, 1):
        if AGE_RECIPIENT_RE.fullmatch(text) is None:
            # Never quoted: an age identity given by mistake opens every backup.
            raise UsageError(f"--recipient {number} is not an age X25519 recipient (age1…); "
                           "not shown, as it may be an identity (a secret)")
    return recipients


def _create_partial(out: Path) -> tuple[Path, int]:
    """Refuse an existing `out`; remove the partial files of earlier runs to `out` (killed
    before theirs was whole: said on stderr); create this run's partial file, new."""
    if os.path.lexists(out):
        raise _exists(out)
    prefix = f".{out.name}."
    partial = out.with_name(f"{prefix}{secrets.token_hex(4)}.partial")
    try:
        with os.scandir(out.parent) as entries:
            left = [Path(e.path) for e in entries
                    if e.name.startswith(prefix) and _PARTIAL.fullmatch(e.name[len(prefix):])]
        for path in left:
            path.unlink(missing_ok=True)
            print(f"removed {path}: left by a backup to {out} that did not finish",
                  file=sys.stderr)
        return partial, os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CliError(f"cannot create {out}: {exc.strerror}") from None


def _exists(out: Path) -> CliError:
    return CliError(f"{out} exists; a backup never overwrites a file")


def _backup(args: argparse.Namespace, config: Config) -> int:
    if config.custody.custodian_socket:
        return _backup_by_custodian(args, config, Path(config.custody.custodian_socket))
    if not args.recipient or args.out is None:
        raise UsageError("keys backup needs --recipient age1… and --out FILE")
    recipients = _recipients(args.recipient)
    out: Path = args.out
    with recorded(Path(config.state.dir), KeyAction.BACKUP, file=clip(str(out)),
                  recipients=recipients) as trail:
        agents, digest = _write_backup(config, recipients, out, trail)
    print(f"backed up {len(agents)} agents to {out} (sha256 {digest})")
    return 0


def _write_backup(config: Config, recipients: tuple[str, ...], out: Path,
                  trail: KeyTrail) -> tuple[tuple[str, ...], str]:
    """Unseal and encrypt every live agent into a partial file, link it to `out` once whole,
    record the outcome.

    The partial file is removed on any fault, and `out` too if the outcome cannot be
    recorded: a backup the key-event log does not name (by sha256) is not left behind.
    """
    from custody import Custody, CustodyError, export_backup
    from custody.custodian.backup import write_synced

    partial, fd = _create_partial(out)
    try:
        async def main() -> tuple[bytes, tuple[str, ...]]:
            async with await Custody.open(config.pkcs11.token(), Path(config.state.dir)) as custody:
                exported = await export_backup(custody, recipients, _public_entries(config))
                return exported.ciphertext, exported.agents

        try:
            ciphertext, agents = trio.run(main)
        except CustodyError as exc:
            raise CliError(str(exc)) from None
        try:
            write_synced(fd, partial, out, ciphertext)
        except FileExistsError:  # made since `_create_partial` looked: not ours, left alone
            raise _exists(out) from None
        except OSError as exc:
            raise CliError(f"cannot write {out}: {exc.strerror}") from None
        digest = hashlib.sha256(ciphertext).hexdigest()
        try:
            trail.done(agents=len(agents), pubkeys=agents, sha256=digest)
        except BaseException:
            out.unlink(missing_ok=True)
            raise
    finally:
        os.close(fd)
        partial.unlink(missing_ok=True)  # linked to `out` once whole, else a fault's
    return agents, digest


def _public_entries(config: Config) -> dict[str, dict[str, object]]:
    """Each live agent's directory entry, for custody to carry in the backup."""
    with agent_directory(config) as directory:
        return {r.pubkey: {"name": r.name, "creator": r.creator} for r in directory.agents()}


def _backup_by_custodian(args: argparse.Namespace, config: Config, socket: Path) -> int:
    """Ask the custodian for a backup to its own recipients and directory."""
    from custody import CustodyError
    from custody.custodian.client import BackupWritten, CustodianClient

    if args.recipient or args.out is not None:
        raise UsageError("with a custodian ([custody] custodian_socket) a backup goes to its "
                         "own recipients and directory ([backup] in the custodian's file); "
                         "drop --recipient and --out")
    with recorded(Path(config.state.dir), KeyAction.BACKUP) as trail:
        async def main() -> BackupWritten:
            client = CustodianClient(socket)
            try:
                # The key records are the custodian's (the keystore is not ours to open).
                with agent_directory(config) as directory:
                    names = {r.pubkey: (r.name, r.creator) for r in directory.agents()}
                return await client.backup(names)
            finally:
                await client.aclose()

        try:
            written = trio.run(main)
        except CustodyError as exc:
            raise CliError(f"custodian: {exc}") from None
        trail.done(agents=len(written.agents), pubkeys=written.agents, sha256=written.sha256,
                   file=clip(written.file), recipients=written.recipients)
    print(f"backed up {len(written.agents)} agents to {written.file} (sha256 {written.sha256}),"
          " the custodian's file")
    return 0


def enroll_restored(config: Config, entries: dict[str, Mapping[str, object]]) -> None:
    """Write the backed-up names of agents that have none here; a bad entry is said."""
    with agent_directory(config, "the keys are restored, but their names were not "
                         "({}); run the restore again to write them") as directory:
        for pubkey, entry in entries.items():
            name, creator = entry.get("name"), entry.get("creator")
            try:
                if not isinstance(name, str) or not (creator is None or isinstance(creator, str)):
                    raise ValueError("no valid name in the backup")
                directory.enroll(pubkey, name, creator)
            except ValueError as exc:
                print(f"{pubkey}: restored without its name ({exc}); set one with "
                      f"buzz-broker agent name {pubkey} NAME", file=sys.stderr)


def _read_bounded(path: Path, limit: int, what: str, *, private: bool) -> bytearray:
    from custody import CustodyError
    from custody._files import read_bounded

    try:
        return read_bounded(path, limit, what, private=private)
    except CustodyError as exc:
        raise CliError(str(exc)) from None


def _confirm(count: int, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise CliError("restore not confirmed: no terminal to ask on; pass --yes")
    print(f"restore {count} agents under this host's KEK? [y/N] ", end="", file=sys.stderr,
          flush=True)
    return sys.stdin.readline().strip().lower() in _YES


def _restore(args: argparse.Namespace, config: Config) -> int:
    from custody import MAX_BACKUP_BYTES

    ciphertext = bytes(_read_bounded(args.backup, MAX_BACKUP_BYTES, "backup", private=False))
    with recorded(Path(config.state.dir), KeyAction.RESTORE, file=clip(str(args.backup)),
                  sha256=hashlib.sha256(ciphertext).hexdigest()) as trail:
        result = _restore_keys(args, config, ciphertext, trail)
    print(f"restored {len(result.restored)} agents; {len(result.already_held)} already held",
          file=sys.stderr)
    return 0


def _restore_keys(args: argparse.Namespace, config: Config, ciphertext: bytes,
                  trail: KeyTrail) -> RestoreResult:
    """Decrypt, check, confirm and seal the backup's agents; record what was sealed."""
    from custody import (
        MAX_IDENTITY_BYTES,
        Custody,
        CustodyError,
        open_backup,
        restore_backup,
        restore_plan,
    )

    identity = _read_bounded(args.identity, MAX_IDENTITY_BYTES, "identity file", private=True)

    entries: dict[str, Mapping[str, object]] = {}

    async def main() -> RestoreResult | None:
        try:
            contents = open_backup(ciphertext, identity)  # zeroes `identity`
        finally:
            identity[:] = bytes(len(identity))
        with contents:
            async with await Custody.open(config.pkcs11.token(), Path(config.state.dir)) as custody:
                plan = restore_plan(custody, contents)
                held = set(plan.already_held)
                for record in contents.records:
                    state = "already held" if record.pubkey in held else "restore"
                    name = contents.public(record.pubkey).get("name")
                    # printable_json: a hostile backup's name cannot reach the terminal raw.
                    print(f"{record.pubkey}  owner={record.owner}  "
                          f"{'auth-tag' if record.auth_tag else '-'}  {state}  "
                          f"{printable_json(name) if isinstance(name, str) else '-'}")
                    entries[record.pubkey] = contents.public(record.pubkey)
                if not plan.restored:
                    return plan
                if not _confirm(len(plan.restored), args.yes):
                    return None
                return await restore_backup(custody, contents)

    try:
        result = trio.run(main)
    except CustodyError as exc:
        raise CliError(str(exc)) from None
    if result is None:
        raise CliError("restore not confirmed; nothing restored")
    # Recorded before the names: the keys are sealed now, whatever happens to the names.
    trail.done(agents=len(result.restored), pubkeys=tuple(result.restored),
               held=len(result.already_held))
    # Every agent of the backup held here now: `enroll` keeps a name already set, and a
    # rerun writes the names a failed first run did not.
    enroll_restored(config, entries)
    return result


SUBCOMMANDS = {"backup": _backup, "restore": _restore}


def run(args: argparse.Namespace, config: Config) -> int:
    return SUBCOMMANDS[args.keys_command](args, config)
