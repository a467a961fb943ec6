"""`buzz-broker custodian FILE` / `python -m custody.custodian FILE`: run the custodian.

`... FILE --recover PUBKEY` instead brings back a key destroyed within the grace period
(custody/custodian/grace.py), beside a running custodian, under the custodian's uid, and exits
(custody/custodian/recover.py, imported only then); `... FILE --forget-destroyed [PUBKEY ...]`
drops the records of keys destroyed past it, or those named (custody/custodian/forget.py);
`... FILE --verify-log` checks the signed log's chain, reading only (custody/custodian/verify.py).
`... FILE keys init|rotate|migrate ...` runs a KEK command with the custodian stopped
(custody/custodian/keys.py, imported only then: the serving process never loads either).
Words none of these forms take (a `-` word where FILE goes among them) are the usage line on
stderr and exit 2, before FILE is read; `-h`/`--help` anywhere is that line on stdout, exit 0.

Opens custody (token login, KEK check, keystore), then serves the message table until
SIGTERM/SIGINT (SIGHUP: one line, no reload), on the socket systemd passed
(buzz-custodian.socket: the daemon's first request activates it) or else one it binds.
A fault opening (a signed log whose last line is not its own among them) is one line on
stderr and exit 1. Under systemd, `Restart=always` brings it back after a crash; the
pipeline's client reconnects (custody/custodian/client.py).
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from custody import Custody, CustodyError, harden_process
from custody.custodian.activation import ActivationError, inherited_socket
from custody.custodian.config import ConfigError, CustodianConfig, load
from custody.custodian.ledger import BrokenLog, chain_head
from custody.custodian.server import Custodian, record_bound, refuse_if_served, serve

__all__ = ["EXIT_USAGE", "USAGE", "UsageError", "main", "run"]

#: Exit status of a command line none of the forms takes (docs/operations.md).
EXIT_USAGE = 2
USAGE = ("usage: buzz-broker custodian FILE [--recover PUBKEY | --forget-destroyed [PUBKEY ...] "
         "| --verify-log | keys init|rotate|migrate|restore ...]")


class UsageError(Exception):
    """Words none of the command's forms take: its usage line (keys.py raises it too)."""


async def run(config_path: str) -> None:
    config = load(config_path)
    # Before the token: a unit whose socket is not the configured one fails at once.
    inherited = inherited_socket(config.settings.socket)
    if inherited is None:
        refuse_if_served(config.settings.socket)
        # 0750 whatever the umask, as buzz-custodian.socket's DirectoryMode=: the pipeline's
        # group reaches the socket, nobody else lists the directory.
        parent = config.settings.socket.parent
        try:
            if not parent.is_dir():
                parent.mkdir(mode=0o750, parents=True, exist_ok=True)
                parent.chmod(0o750)
        except OSError as exc:
            raise ConfigError(f"socket directory {parent}: {exc.strerror}") from None
    chain_head(config.settings.log_path)  # a log it cannot go on: refused before the token
    harden_process()
    custody = await Custody.open(config.token, config.state_dir, config.cache,
                                 records=record_bound(config.settings))
    # Every change is a line of the signed log; custody's own line for each (no change but
    # `sign` is rate-bounded) would let a pipeline flood the unit's journal past its rate
    # limit, which then drops the lines that matter, the unseal door's warnings among them.
    logging.getLogger("buzz_broker.custody").setLevel(logging.WARNING)
    try:
        custodian = Custodian(custody, config.settings)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(serve, custodian, inherited=inherited))
                print("custodian: listening", flush=True)
                async for signum in signals:
                    if signum == signal.SIGHUP:  # the daemon's reload signal: not a stop here
                        logging.getLogger("buzz_broker.custodian").warning(
                            "no reload: restart the custodian to apply its configuration")
                        continue
                    nursery.cancel_scope.cancel()
                    break
    finally:
        with trio.CancelScope(shield=True):
            await custody.aclose()


async def recover(config_path: str, pubkey: str) -> None:
    from custody.custodian import recover as command

    await command.recover(config_path, pubkey)


async def forget(config_path: str, pubkeys: list[str]) -> None:
    from custody.custodian import forget as command

    await command.forget(config_path, pubkeys)


async def keys(config_path: str, words: list[str]) -> None:
    from custody.custodian import keys as commands

    await commands.run(load(config_path), words)


def refuse_foreign_state(config: CustodianConfig) -> None:
    """As root, refuse a state, log or SoftHSM token directory (or its nearest existing
    parent) another user owns: what root made there the custodian's user could not open
    (the daemon's rule for its own state, daemon/cli/_common.py `refuse_foreign_state`)."""
    if os.geteuid() != 0:
        return
    try:
        _refuse_foreign_state(config)
    except OSError as exc:  # a path too long, a directory it may not look in
        raise ConfigError(f"{exc.filename or config.state_dir}: {exc.strerror}") from None


def _refuse_foreign_state(config: CustodianConfig) -> None:
    conf = Path(os.environ.get("SOFTHSM2_CONF", "/etc/softhsm/softhsm2.conf"))
    lines = conf.read_text("utf-8", "replace").splitlines() \
        if "softhsm" in config.token.module and conf.is_file() else []
    tokens = [Path(value.strip()) for key, _, value in (line.partition("=") for line in lines)
              if key.strip() == "directories.tokendir"]
    for directory in (config.state_dir, config.settings.log_path.parent, *tokens):
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
        if (owner := directory.stat().st_uid) != 0:
            try:  # one lookup, not a walk of every user (a directory service may hold many)
                name = pwd.getpwuid(owner).pw_name
            except KeyError:
                name = f"uid {owner}"
            raise ConfigError(
                f"refusing to run as root on {directory}: it belongs to {name}, the "
                f"custodian's user, and files root creates there would be unreadable to it; "
                f"run it as that user: buzz-custodian-admin ARGUMENTS (or runuser -u {name} "
                f"-- buzz-broker custodian FILE ARGUMENTS)")


def _work(args: list[str]) -> Callable[[], Awaitable[None]]:
    """The form `args` name, to run once FILE is read. Raises UsageError."""
    if len(args) == 3 and args[1] == "--recover":
        from custody.custodian.recover import check_named

        check_named(args[2])
        return functools.partial(recover, args[0], args[2])
    if len(args) >= 2 and args[1] == "--forget-destroyed":
        from custody.custodian.forget import check_named as check_all_named

        check_all_named(args[2:])
        return functools.partial(forget, args[0], args[2:])
    if len(args) >= 2 and args[1] == "keys":
        from custody.custodian.keys import parse

        parse(args[2:])
        return functools.partial(keys, args[0], args[2:])
    if len(args) == 1:
        return functools.partial(run, args[0])
    raise UsageError(USAGE)


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--config"]
    if {"-h", "--help"} & set(args):  # as the daemon's `custodian`: nothing read or opened
        print(USAGE)
        return 0
    if args[:1] and args[0].startswith("-"):  # a word, not a file to read
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    if args[1:] == ["--verify-log"]:  # reads only, and needs no token: root may run it too
        from custody.custodian import verify

        return verify.main(args[0])
    try:
        work = _work(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="custodian: %(message)s", stream=sys.stderr)
    try:
        refuse_foreign_state(load(args[0]))  # before any command writes, serving too
        trio.run(work)
    except (ConfigError, ActivationError, CustodyError, BrokenLog) as exc:
        print(f"custodian: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file mistake no step above names: still one line, no traceback
        print(f"custodian: {exc.filename or args[0]}: {exc.strerror or type(exc).__name__}",
              file=sys.stderr)
        return 1
    return 0
