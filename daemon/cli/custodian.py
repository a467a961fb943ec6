"""`buzz-broker custodian FILE`: run the custodian (custody/custodian/main.py) in the foreground.

FILE is the custodian's own configuration (custody/custodian/config.py), not the daemon's. Only
the custodian package is imported here: nothing of the daemon's pipeline loads into the
process that holds the keys.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the custodian's configuration file")
    parser.add_argument("--recover", metavar="PUBKEY",
                        help="bring back a key destroyed within the grace period, and exit")
    parser.add_argument("--forget-destroyed", action="store_true",
                        help="drop the records of keys destroyed past the grace period "
                             "(none that a kept record names as owner), and exit")
    parser.add_argument("words", nargs=argparse.REMAINDER, metavar="keys ...",
                        help="keys init | keys rotate [--new-kek-label L] | keys migrate "
                             "--to-config FILE2 [--new-kek-label L]: with the custodian "
                             "stopped, under its uid (docs/custodian.md)")


def run(args: argparse.Namespace) -> int:
    from custody.custodian.main import main

    return main([args.file] + ([] if args.recover is None else ["--recover", args.recover])
                + (["--forget-destroyed"] if args.forget_destroyed else []) + list(args.words))
