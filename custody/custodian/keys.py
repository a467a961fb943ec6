"""`buzz-broker custodian FILE keys init|rotate|migrate|restore`: the KEK and restoring a
backup, with the custodian stopped.

Why its own command: making, rotating and moving the key-encryption key are not in the
message table (a compromised pipeline must not start one), and they need what only the
custodian's uid can reach, the PIN and the token's files. So they run as this command,
under that uid, from the custodian's own configuration FILE (its `[pkcs11]` and
`state_dir`); the serving process never imports this module (tests/custodian/test_size.py).

Rules:
- `init` makes the KEK where absent, else checks it (custody/_kekinit.py); safe to repeat.
- `rotate [--new-kek-label L]` reseals every agent under a new KEK in the same token,
  `migrate --to-config FILE2 [--new-kek-label L]` under one in the token FILE2's
  `[pkcs11]` names; both then destroy the old KEK (custody/_rotation.py: crash-safe, run
  again to finish). They hold the state directory's lock exclusively: they refuse while
  the custodian runs, and it refuses to start meanwhile (custody/_statelock.py).
- Destroyed keys still within their grace period (grace.py) are sealed under the KEK a
  rotation destroys: `rotate` and `migrate` refuse while any is held, naming how many
  and both ways on (`--recover` each first, or `--abandon-destroyed`, which gives them up:
  their copies are deleted once the old KEK is, before the log line that counts them).
- Each rotation or migration is in the custodian's own hash-chained log (ledger.py),
  written while the state lock is held (a custodian starting once it is free reads the
  chain's head after them): an `intent` line before anything changes (so a run killed
  anywhere has a line), then its outcome naming the intent's seq: op, the old and new
  token and KEK labels, the agent count; or `failed`.
- `restore --identity ID [--yes] [--names-out NAMES] BACKUP` restores an age backup into
  the custodian's keystore and token, with custody's checks (custody/_restore.py: every
  entry checked before anything is shown; an agent held for another owner, removed here,
  a mint reference taken, an ownership cycle refuse the whole restore). It opens custody
  with the state lock held exclusively, so it refuses beside a running custodian (whose
  records, version and log would not see the restore), then the custodian's log (a log
  whose last line is not its own refuses the restore there, `BrokenLog`: nothing listed
  or restored), lists the backup's agents on stdout, asks on the terminal unless `--yes`
  (no terminal and no `--yes`: refused), and, when there is anything to seal, writes its
  `intent` line (the backup's sha256, the count to seal) on disk before sealing; then one
  line per agent sealed and the counts, the file's path and sha256, naming the intent's
  seq; or `failed` if the sealing raised. A run killed between leaves its intent with no
  outcome: run again, it seals the rest under an intent of its own, or, all held, writes
  its counts alone. Then it prints the daemon's `keys restore` summary on stderr. ID is
  read only if it is a regular file, not a symlink, mode 0600 or stricter.
- Names are the daemon's directory's, not the custodian's: `--names-out NAMES` writes a
  new file (O_EXCL, 0600; removed if the restore fails), for `buzz-broker agent
  import-names < NAMES` under the daemon's uid: a first line `{"restore": {"file",
  "sha256"}}` (the backup as this restore read it), then each backup agent's public entry
  and whether this run sealed it (`{"pubkey", "name", "creator", "restored"}`, name null
  when the backup has none; public only). `import-names` writes the names and records the
  restore in the daemon's key-event log from it (its `custodian-restore` lines): this uid
  cannot write that log. Without `--names-out` the names stay in the backup, the agents
  are listed under their pubkey's first 12 hex digits until named, and only this
  custodian's log records the restore.
- Prints public lines only; a fault is one line on stderr and exit 1, words it does not
  take its usage line and exit 2, before FILE is read (`parse`, main.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from custody._errors import CustodyError
from custody._keys import init_keys, rotate_keys
from custody._rotation import RotationReport
from custody._keystore import KEYSTORE_FILE, ReadIndex
from custody.custodian.changes import append, logged_change, open_log
from custody.custodian.config import ConfigError, CustodianConfig, load
from custody.custodian.forget import forget_copy
from custody.custodian.grace import Graveyard
from custody.custodian.ledger import failed_line
from custody.custodian.main import UsageError

if TYPE_CHECKING:  # imported by `restore` alone, when it runs
    from custody._restore import BackupContents, RestoreResult

__all__ = ["USAGE", "parse", "run"]

USAGE = ("keys init | keys rotate [--new-kek-label LABEL] [--abandon-destroyed] | "
         "keys migrate --to-config FILE2 [--new-kek-label LABEL] [--abandon-destroyed] | "
         "keys restore --identity ID [--yes] [--names-out NAMES] BACKUP")
#: subcommand -> the options it takes (each with one value)
_OPTIONS = {"init": (), "rotate": ("--new-kek-label",),
            "migrate": ("--to-config", "--new-kek-label"),
            "restore": ("--identity", "--names-out")}
#: subcommand -> the options it requires
_REQUIRED = {"migrate": ("--to-config",), "restore": ("--identity",)}
#: subcommand -> the flags it takes (no value)
_FLAGS = {"rotate": ("--abandon-destroyed",), "migrate": ("--abandon-destroyed",),
          "restore": ("--yes",)}
#: Answers that confirm a restore at the prompt (the daemon's `keys restore` takes the same).
_YES = frozenset({"y", "yes"})


def parse(words: list[str]) -> tuple[str, dict[str, str]]:
    """The subcommand `words` name and its options (BACKUP and each flag's too, flags as
    ""). Raises UsageError: words it does not take, a required option missing."""
    command = words[0] if words else ""
    return command, _options(command, words[1:])


def _options(command: str, words: list[str]) -> dict[str, str]:
    usage = UsageError(f"usage: buzz-broker custodian FILE {USAGE}")
    if command not in _OPTIONS:
        raise usage
    flags = [w for w in words if w in _FLAGS.get(command, ())]
    words = [w for w in words if w not in flags]
    if command == "restore":  # its one positional BACKUP
        if len(words) % 2 == 0 or words[-1].startswith("--"):
            raise usage
        words, backup = words[:-1], words[-1]
    if len(words) % 2:
        raise usage
    options = dict(zip(words[::2], words[1::2], strict=True))
    unknown = set(options) - set(_OPTIONS[command])
    if unknown or len(options) * 2 != len(words) or not all(
            o in options for o in _REQUIRED.get(command, ())):
        raise usage
    if command == "restore":
        options["BACKUP"] = backup
    options.update(dict.fromkeys(flags, ""))
    return options


async def run(config: CustodianConfig, words: list[str]) -> None:
    """Run `keys WORDS...` for `config`. Raises UsageError, ConfigError (FILE2) or
    CustodyError."""
    command, options = parse(words)
    if command == "restore":
        await _restore(config, options)
        return
    if command == "init":
        made = await init_keys(config.token, config.state_dir)
        created = ", ".join(made.created) or "none (present and checked)"
        print(f"custodian: KEK {made.kek_label!r} in token {made.token_label!r}, seal "
              f"{made.seal}; keys created: {created}", flush=True)
        return
    target = load(options["--to-config"]).token if command == "migrate" else None
    if target is not None and (target.token_label, target.module) == (
            config.token.token_label, config.token.module):
        raise ConfigError("--to-config names the same token; use `keys rotate`")
    graveyard = Graveyard.beside(config.settings.log_path, config.settings.destroy_grace_seconds)
    index = ReadIndex(config.state_dir / KEYSTORE_FILE)
    try:  # a live key's copy is one `--recover` left (recover.py): nothing to give up
        held = [p for p in graveyard.purge() if (r := index.get(p)) is None or not r.live]
    finally:
        index.close()
    if held and "--abandon-destroyed" not in options:
        raise ConfigError(
            f"{len(held)} destroyed key(s) can still be recovered, sealed under the KEK "
            f"`keys {command}` destroys: recover each first (`buzz-broker custodian FILE "
            "--recover PUBKEY`), or pass --abandon-destroyed to give them up")
    report = await rotate_keys(
        config.token, config.state_dir, target=target,
        new_kek_label=options.get("--new-kek-label"),
        journal=_Journal(config, command, held, graveyard, {
            "old_token": config.token.token_label,
            "new_token": (target or config.token).token_label}))
    print(f"custodian: {report.agents} agents under KEK {report.new.kek_label!r} in token "
          f"{report.new.token_label!r} ({report.outcome}); destroyed: "
          f"{', '.join(report.destroyed) or 'none'}", flush=True)


class _Journal:
    """A rotation's lines in the custodian's log, by `rotate` under the state lock
    (custody/_rotation.py `Journal`): the log is opened there too, as the chain's head
    read before the lock could be stale by then. The intent names what is known."""

    def __init__(self, config: CustodianConfig, op: str, abandoned: list[str],
                 graveyard: Graveyard, known: dict[str, str]) -> None:
        self._config, self._op, self._known = config, op, known
        self._abandoned, self._graveyard = abandoned, graveyard
        self._seq = 0

    def _line(self, entry: dict[str, object], what: str) -> int:
        log = open_log(self._config, what)
        try:
            return append(log, [entry], what)
        finally:
            log.close()

    def begun(self) -> None:
        self._seq = self._line({"op": "intent", "for": self._op, **self._known,
                                "abandoned": len(self._abandoned)}, "nothing was changed")

    def done(self, report: RotationReport) -> None:
        # Their KEK is gone: no way back. Before the line, so a line that cannot be
        # written leaves no copy a later run would call recoverable.
        for pubkey in self._abandoned if report.destroyed else ():
            forget_copy(self._graveyard, pubkey)
        self._line({"op": self._op, "agents": report.agents, "outcome": report.outcome,
                    "abandoned": len(self._abandoned),
                    "old_token": report.old.token_label, "old_kek": report.old.kek_label,
                    "new_token": report.new.token_label, "new_kek": report.new.kek_label,
                    "intent": self._seq},
                   f"`keys {self._op}` is done, and its intent line stands for it")

    def failed(self, fault: Exception, *, swapped: bool | None) -> None:
        with contextlib.suppress(CustodyError):  # the fault that ended the run is the one said
            self._line({**failed_line(self._seq, fault), "swapped": swapped}, "")


def _confirmed(count: int, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise CustodyError("restore not confirmed: no terminal to ask on; pass --yes")
    print(f"restore {count} agents under the custodian's KEK? [y/N] ", end="",
          file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in _YES


def _names_file(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise CustodyError(f"--names-out {path} exists; it is never overwritten") from None
    except OSError as exc:
        raise CustodyError(f"cannot create --names-out {path}: {exc.strerror}") from None


def _write_names(fd: int, path: Path, text: str) -> None:
    """`text` into the new `--names-out` file `fd` (`path`), synced; a fault removes it and
    is one line: the restore and its log lines are done by then."""
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise CustodyError(f"cannot write --names-out {path}: {exc.strerror}; the restore is "
                           "done and in the custodian's log: run it again with another "
                           "--names-out (every agent then already held)") from None


def _names_text(backup: str, digest: str, entries: list[tuple[str, str | None, object]],
                restored: set[str]) -> str:
    """The `--names-out` file: the restore's header, then one line per backup agent."""
    def line(value: dict[str, object]) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n"

    return line({"restore": {"file": backup, "sha256": digest}}) + "".join(
        line({"pubkey": pubkey, "name": name, "creator": creator,
              "restored": pubkey in restored}) for pubkey, name, creator in entries)


def _restored_lines(result: RestoreResult, digest: str, backup: Path,
                    intent: int | None) -> list[dict[str, object]]:
    """A restore's outcome: one line per agent sealed (one naming thousands would outgrow
    the log's tail read), then the counts, naming the intent's seq when it had one."""
    lines: list[dict[str, object]] = [{"op": "restore", "agent": pubkey, "sha256": digest}
                                      for pubkey in result.restored]
    lines.append({"op": "restore", "agents": len(result.restored),
                  "held": len(result.already_held), "sha256": digest, "file": str(backup),
                  **({} if intent is None else {"intent": intent})})
    return lines


def _listed(contents: BackupContents, held: set[str]) -> list[tuple[str, str | None, object]]:
    """Each backup agent on stdout, as the daemon's `keys restore` lists them; each one's
    pubkey, name (None if it has none) and creator."""
    from buzzwire.contract import printable_json

    entries: list[tuple[str, str | None, object]] = []
    for record in contents.records:
        public = contents.public(record.pubkey)
        name = public.get("name")
        # printable_json: a hostile backup's name cannot reach the terminal raw.
        print(f"{record.pubkey}  owner={record.owner}  "
              f"{'auth-tag' if record.auth_tag else '-'}  "
              f"{'already held' if record.pubkey in held else 'restore'}  "
              f"{printable_json(name) if isinstance(name, str) else '-'}", flush=True)
        entries.append((record.pubkey, name if isinstance(name, str) else None,
                        public.get("creator")))
    return entries


async def _restore(config: CustodianConfig, options: dict[str, str]) -> None:
    from custody import _restore as restoring  # restore_backup looked up when it runs
    from custody._facade import Custody
    from custody._files import read_bounded
    from custody._restore import MAX_BACKUP_BYTES, MAX_IDENTITY_BYTES, open_backup, restore_plan

    backup = Path(options["BACKUP"])
    ciphertext = bytes(read_bounded(backup, MAX_BACKUP_BYTES, "backup", private=False))
    digest = hashlib.sha256(ciphertext).hexdigest()
    identity = read_bounded(Path(options["--identity"]), MAX_IDENTITY_BYTES,
                             "identity file", private=True)
    names_path = Path(options["--names-out"]) if "--names-out" in options else None
    fd: int | None = None
    try:
        contents = open_backup(ciphertext, identity)  # zeroes `identity`
    finally:
        identity[:] = bytes(len(identity))
    with contents:
        # Exclusive: beside a running custodian its records, version and log would not
        # see the restore (and the log would fork): stop it first, as for rotate.
        async with await Custody.open(config.token, config.state_dir, config.cache,
                                      exclusive=True) as custody:
            # The log next, under the lock, so no custodian starting meanwhile forks the
            # chain; one whose last line is not its own (BrokenLog) refuses the restore
            # here, before anything is listed, asked or restored.
            log = open_log(config, "nothing restored")
            try:
                plan = restore_plan(custody, contents)
                entries = _listed(contents, set(plan.already_held))
                result: RestoreResult = plan
                if plan.restored and not _confirmed(len(plan.restored), "--yes" in options):
                    raise CustodyError("restore not confirmed; nothing restored")
                fd = None if names_path is None else _names_file(names_path)
                if plan.restored:  # write-ahead, as every change (changes.py): a run killed
                    # before its outcome leaves its intent
                    result = await logged_change(
                        log, {"for": "restore", "sha256": digest, "agents": len(plan.restored)},
                        functools.partial(restoring.restore_backup, custody, contents),
                        lambda done, seq: _restored_lines(done, digest, backup, seq))
                else:  # nothing to seal: no intent to name, its counts alone
                    append(log, _restored_lines(plan, digest, backup, None),
                           "nothing was restored")
                if fd is not None and names_path is not None:  # after the lines: a names
                    names_fd, fd = fd, None  # file that fails loses none of them
                    _write_names(names_fd, names_path, _names_text(
                        str(backup), digest, entries, set(result.restored)))
            finally:
                log.close()
                if fd is not None:  # refused or failed before its names were written
                    os.close(fd)
                    names_path.unlink(missing_ok=True)  # type: ignore[union-attr]
    if names_path is not None:
        print(f"custodian: the backup's names and this restore's summary are in "
              f"{names_path}; give them to the daemon's directory and key-event log: "
              f"buzz-broker agent import-names < {names_path}", file=sys.stderr)
    print(f"restored {len(result.restored)} agents; {len(result.already_held)} already held",
          file=sys.stderr, flush=True)
