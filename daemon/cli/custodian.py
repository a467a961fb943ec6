"""`buzz-broker custodian FILE`: run the custodian (custody/custodian/main.py) in the foreground.

FILE is the custodian's own configuration (custody/custodian/config.py), not the daemon's. Only
the custodian package is imported here: nothing of the daemon's pipeline loads into the
process that holds the keys.

The words after FILE are the custodian's (custody/custodian/main.py parses them, not
argparse), so `--help` among them (or as FILE, after `--`) is answered here: the usage on
stdout, exit 0, from custody/custodian/keys.py's `USAGE` (imported only then: the serving
process never loads it), with nothing read or opened.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]

_HELP = frozenset({"-h", "--help"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the custodian's configuration file")
    parser.add_argument("--recover", metavar="PUBKEY",
                        help="bring back a key destroyed within the grace period, and exit")
    parser.add_argument("--forget-destroyed", action="store_true",
                        help="drop the records of keys destroyed past the grace period, "
                             "or, given PUBKEY ... after it, exactly those destroyed keys at "
                             "once, with their grace copies (none that a kept record names "
                             "as owner), and exit")
    words = parser.add_argument(
        "words", nargs=argparse.REMAINDER, metavar="keys ... | --verify-log",
        help="the KEK commands and restoring a backup, with the custodian stopped, under its "
             "uid: `buzz-broker custodian FILE keys --help` lists them (docs/custodian.md); "
             "or --verify-log, the signed log's chain checked")
    # argparse counts a REMAINDER positional as required, so without FILE its line named
    # `keys ...` required too: none of these words is (`custodian FILE` serves).
    words.required = False


def _usage() -> str:
    """One line per form: serve, recover, forget, then each `keys` subcommand with its
    options."""
    from custody.custodian.keys import USAGE

    forms = ["", " --recover PUBKEY", " --forget-destroyed [PUBKEY ...]", " --verify-log",
             *(f" {form}" for form in USAGE.split(" | "))]
    return "\n".join(f"{'usage:' if i == 0 else '      '} buzz-broker custodian FILE{form}"
                     for i, form in enumerate(forms))


def run(args: argparse.Namespace) -> int:
    if _HELP & {args.file, args.recover, *args.words}:  # `-- --help` puts it in FILE
        print(_usage())
        return 0
    from custody.custodian.main import main

    return main([args.file] + ([] if args.recover is None else ["--recover", args.recover])
                + (["--forget-destroyed"] if args.forget_destroyed else []) + list(args.words))
