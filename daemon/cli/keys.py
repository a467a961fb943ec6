"""`buzz-broker keys init`: create the token's key-encryption key, or check the one there.
`keys backup` / `keys restore` live in keys_backup.py (their rules are there).

Rules:
- Reads the token settings from the configuration ([pkcs11]); the PIN from the file
  `pin_file` names, or the systemd credential `token-pin`. Never argv.
- Prints one public line on stdout: whether the KEK was created or found and checked.
- A KEK that could leave the token (extractable, not sensitive, ...) is a fault: CliError
  names the attribute, exit 1. Running it twice is safe.

WARNING: README.md ("The command line") and docs/install.md (step 6) show this command;
keep them in step with `add_arguments`.
"""

from __future__ import annotations

import argparse

import trio

from daemon.cli import keys_backup
from daemon.cli._common import CliError, config_from_args

HELP = "create (or check) the key-encryption key in the PKCS#11 token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    sub.required = True
    sub.add_parser(
        "init",
        help="create the AES-256 KEK (sensitive, non-extractable) if absent, else check it",
    )
    keys_backup.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    if args.keys_command in keys_backup.SUBCOMMANDS:
        return keys_backup.run(args)
    from custody import CustodyError, TokenConfig, init_kek

    config = config_from_args(args)
    token = TokenConfig(
        module=config.pkcs11.module,
        token_label=config.pkcs11.token_label,
        pin_file=config.pkcs11.pin_file,
        kek_label=config.pkcs11.kek_label,
    )
    try:
        created = trio.run(init_kek, token)
    except CustodyError as exc:
        raise CliError(str(exc)) from None
    verb = "created" if created else "present and checked:"
    print(
        f"KEK {token.kek_label!r} {verb} sensitive, non-extractable, private, "
        f"in token {token.token_label!r}"
    )
    return 0
