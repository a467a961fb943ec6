"""`buzz-broker keys init|rotate|migrate`: the token's key-encryption keys.
`keys backup` / `keys restore` live in keys_backup.py (their rules are there).

Rules:
- Reads the token settings from the configuration ([pkcs11]); the PIN from the file
  `pin_file` names, or the systemd credential `token-pin`. Never argv.
- Prints public lines only on stdout: what the token offers, the seal chosen, each key
  created or found and checked; for rotate/migrate, what moved where and what was destroyed.
- `init` never downgrades silently: it says which seals the token offers and which one new
  blobs get, and a seal forced by `[pkcs11] seal` that the token lacks is an error. A key
  that could leave the token (extractable, not sensitive, ...) is a fault: CliError names
  the attribute, exit 1. Running it twice is safe.
- `rotate` and `migrate` run with the daemon DOWN: custody's state lock refuses them while
  the daemon (or any other custody command) has the state directory open, and refuses the
  daemon while they run (custody/_statelock.py). Run again after a crash, they finish the
  interrupted run (custody/_rotation.py).
- `rotate` and `migrate` write an intent line to the key-event log (daemon/cli/_key_trail.py)
  before custody runs, naming the old token and the new token and KEK label as far as they
  are known (the active KEK is custody's to read), and an outcome after: `done` with the
  old and new token/KEK labels and the count, or `failed` with the fault. No intent, no run.
- `migrate --to-config OTHER` reads only OTHER's [pkcs11] table: the token the agents move
  to. Afterwards this configuration's [pkcs11] must name that token (the daemon refuses to
  start with the old one, saying so).
- With a custodian (`[custody] custodian_socket`), `init`, `rotate`, `migrate` and `restore`
  are refused here before anything is read or written, exit 2, in one line naming the
  custodian's own command (`CUSTODIAN_COMMANDS`): the token, its PIN and the keystore are
  the custodian's uid's alone (docs/custodian.md, "Who can do what"), so advice to give this
  uid the PIN, or a rotation of a keystore this uid can open, would undo the layout
  (tests/custodian/test_restore_command.py::test_the_daemons_key_commands_name_the_custodians_under_a_custodian).
  `backup` asks the custodian instead (keys_backup.py).

WARNING: README.md ("The command line") and docs/install.md ("rotate", "move to another
token") show these commands; keep them in step with `add_arguments`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from daemon.cli import keys_backup
from daemon.cli._common import CliError, UsageError, config_from_args
from daemon.cli._key_trail import clip, recorded
from daemon.config import ConfigError, load_config
from daemon.state.audit import MAX_KEY_LABEL, KeyAction

if TYPE_CHECKING:
    from custody import RotationReport, TokenConfig, TokenReport

HELP = "create, check, rotate or move the key-encryption key in the PKCS#11 token"

#: Subcommand -> what it does and the custodian's own command for it (custody/custodian/
#: keys.py `USAGE`), where `[custody] custodian_socket` is set: what follows `keys`, then
#: what the operator does after it. The one table of these refusals (`backup` is not in it:
#: it asks the custodian's `backup` row).
CUSTODIAN_COMMANDS = {
    "init": ("the KEK is made and checked", "init", ""),
    "rotate": ("the KEK is rotated",
               "rotate [--new-kek-label LABEL] [--abandon-destroyed]",
               ", with the custodian stopped"),
    "migrate": ("the agents move to another token",
                "migrate --to-config FILE2 [--new-kek-label LABEL] [--abandon-destroyed]",
                ", FILE2 a copy of its file naming the target token, with the custodian "
                "stopped"),
    "restore": ("the keys are restored",
                "restore --identity ID --names-out NAMES BACKUP",
                ", with the custodian stopped, then buzz-broker agent import-names < NAMES"),
}

#: Seal kind -> how `keys init` names it.
SEAL_NAMES = {
    "gcm": "AES-256-GCM with a host IV",
    "etm": "encrypt-then-MAC (AES-256-ECB keystream + HMAC-SHA256)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    sub.required = True
    sub.add_parser(
        "init",
        help="choose the seal by what the token offers; create the KEK (sensitive, "
             "non-extractable) if absent, else check it",
    )
    p = sub.add_parser("rotate", help="reseal every agent under a new KEK, then destroy the "
                                      "old one (daemon stopped)")
    p.add_argument("--new-kek-label", metavar="LABEL",
                   help="the new KEK's label (a TPM: the keys you made with tpm2_ptool); "
                        "default <kek_label>-<8 hex>, generated in the token")
    p = sub.add_parser("migrate", help="reseal every agent under a KEK in another token, then "
                                       "destroy the old KEK (daemon stopped)")
    p.add_argument("--to-config", metavar="PATH", required=True,
                   help="a configuration whose [pkcs11] table names the target token")
    p.add_argument("--new-kek-label", metavar="LABEL",
                   help="the KEK's label in the target token (default: its kek_label)")
    keys_backup.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.custody.custodian_socket and args.keys_command in CUSTODIAN_COMMANDS:
        raise _custodians(args.keys_command)
    if args.keys_command in keys_backup.SUBCOMMANDS:
        return keys_backup.run(args, config)
    if args.keys_command == "init":
        return _init(config.pkcs11.token(), Path(config.state.dir))
    return rotate(args)


def _custodians(command: str) -> CliError:
    """The refusal of `command` where a custodian holds the keys: its command instead."""
    what, words, after = CUSTODIAN_COMMANDS[command]
    return UsageError(f"with a custodian ([custody] custodian_socket) {what} under its uid, "
                      f"which alone opens the token, its PIN and the keystore: "
                      f"buzz-custodian-admin keys {words} (buzz-broker custodian FILE keys "
                      f"{command}){after}")


def _init(token: TokenConfig, state_dir: Path) -> int:
    from custody import CustodyError, init_keys

    try:
        report = trio.run(init_keys, token, state_dir)
    except CustodyError as exc:
        raise CliError(str(exc)) from None
    for line in init_lines(report, forced=token.seal != "auto"):
        print(line)
    return 0


def init_lines(report: TokenReport, *, forced: bool) -> list[str]:
    """What `keys init` prints: the token's abilities, the seal chosen, each key's state."""
    offered = ", ".join(f"{kind} ({SEAL_NAMES[kind]})" for kind in report.offered) or "none"
    why = "forced by [pkcs11] seal" if forced else "chosen: the best seal the token offers"
    lines = [
        f"token {report.token_label!r} offers: {offered}; generates keys: "
        f"{'yes' if report.can_generate else 'no'}",
        f"seal for new keys: {report.seal} ({SEAL_NAMES[report.seal]}), {why}",
    ]
    keys = [report.kek_label] + ([f"{report.kek_label}-mac"] if report.seal == "etm" else [])
    for label in keys:
        verb = "created" if label in report.created else "present and checked:"
        lines.append(f"KEK {label!r} {verb} sensitive, non-extractable, private, "
                     f"in token {report.token_label!r}")
    return lines


def rotate(args: argparse.Namespace, checkpoint: Callable[[str], None] | None = None) -> int:
    """`keys rotate` / `keys migrate`. `checkpoint` is the crash tests' seam (None here)."""
    from custody import CustodyError, rotate_keys

    if args.new_kek_label == "":  # `--new-kek-label "$UNSET"`: never fall back to a default
        raise UsageError("--new-kek-label is empty: give the new KEK's label, or leave "
                         "--new-kek-label out for the default")
    config = config_from_args(args)
    source = config.pkcs11.token()
    target = None
    if args.keys_command == "migrate":
        try:
            target = load_config(args.to_config).pkcs11.token()
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        if target.token_label == source.token_label and target.module == source.module:
            raise CliError("--to-config names the same token; use `keys rotate`")
    action = KeyAction.MIGRATE if target is not None else KeyAction.ROTATE
    # The intent names what is known before custody runs: the active KEK is custody's to
    # read (it may differ from kek_label after an earlier rotation), a default new label is
    # made by custody. The outcome names all four.
    with recorded(Path(config.state.dir), action, old_token=_label(source.token_label),
                  new_token=_label((target or source).token_label),
                  new_kek=_label(args.new_kek_label) if args.new_kek_label else None) as trail:
        try:
            report = trio.run(lambda: rotate_keys(source, Path(config.state.dir), target=target,
                                                  new_kek_label=args.new_kek_label,
                                                  checkpoint=checkpoint))
        except CustodyError as exc:
            raise CliError(str(exc)) from None
        trail.done(agents=report.agents,
                   old_token=_label(report.old.token_label), old_kek=_label(report.old.kek_label),
                   new_token=_label(report.new.token_label), new_kek=_label(report.new.kek_label))
    for line in rotation_lines(report):
        print(line)
    return 0


def _label(text: str) -> str:
    return clip(text, MAX_KEY_LABEL)


def rotation_lines(report: RotationReport) -> list[str]:
    lines = []
    if report.outcome == "finished":
        lines.append("an interrupted run had already moved every agent; finished it")
    else:
        lines.append(
            f"resealed {report.agents} agent(s): KEK {report.old.kek_label!r} in token "
            f"{report.old.token_label!r} -> KEK {report.new.kek_label!r} in token "
            f"{report.new.token_label!r} (seal {report.seal}); each opened again before "
            "the swap"
        )
    destroyed = ", ".join(repr(label) for label in report.destroyed) or "nothing (already gone)"
    lines.append(f"destroyed in token {report.old.token_label!r}: {destroyed}")
    if report.new.token_label != report.old.token_label:
        lines.append(f"now set [pkcs11] in this configuration to token "
                     f"{report.new.token_label!r} before starting the daemon")
    return lines
