"""Helpers shared by the commands: the one error type and the configuration they run with.

Rules: a command reports every fault as one `CliError` line (never a traceback, never a
secret in the text); a malformed argument, one refused by a check that reads nothing
(no file, no store, no token), as a `UsageError` line, exit `EXIT_USAGE` as argparse's own
refusals, before anything is read or changed; an argument well formed but refused by what
is held (an unknown agent, a credential id not active) stays a `CliError`, exit 1
(docs/operations.md, "Exit codes: every command"). `config_from_args` is the only way a
command reads its configuration, so `--config`, `$BUZZ_BROKER_CONFIG`,
/etc/buzz-broker/broker.toml and the defaults mean the same everywhere (daemon/config.py
states the precedence).

`refuse_foreign_state`: root must not create files in the daemon's state directory. SQLite
databases, their -wal/-shm files and SoftHSM objects made by root are 0600 root: the
daemon's user could no longer open them, and the service would fail at its next start.
Refusing (and naming the way to run as that user) is simpler and safer than chowning
after the fact.

`refuse_unusable_state`: a ``[state] dir`` that exists and is not a directory (a file, a
FIFO, a symlink to a device, or a path through a file) is refused in one line. Left to the
stores, it read as "no agents, no credentials": `Path.exists()` is False under ENOTDIR,
so every lister found nothing and every writer gave a remedy for another fault.

`agent_directory`: the public agent directory for one command, closed after, its faults
one CliError line.

`print_json_line`: the one `--json` convention (docs/operations.md, "JSON output"): JSON
lines, one object per line, one line per item of a list (none for an empty list), so a
list streams and `| head` or `jq -c` read it line by line like `audit show --json`.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing only: the configuration is imported when a command runs
    from custody import Custody
    from daemon.config import Config
    from daemon.state.directory import AgentDirectory


def print_json_line(value: dict[str, object]) -> None:
    """One JSON object on one line of stdout, every control and bidi character escaped
    (`printable_json`): a name an agent chose cannot reach the terminal raw."""
    from buzzwire.contract import printable_json

    print(printable_json(value, compact=True))


class CliError(Exception):
    """A fault an operator must see: one line, no traceback, a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


#: A usage error: argparse's own code for an unknown flag or a value its type refuses, and
#: ours for a malformed argument (`UsageError`).
EXIT_USAGE = 2


class UsageError(CliError):
    """A malformed argument, said as one line and exit `EXIT_USAGE`: the command line is
    wrong, not the host's state (see the module docstring), and nothing was read or
    changed. Raised before the command opens anything."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


#: What an operator runs instead (systemd/buzz-broker-admin, installed by docs/install.md).
ADMIN_WRAPPER = "buzz-broker-admin"


def refuse_foreign_state(config: Config, *, euid: int | None = None) -> None:
    """As root, refuse a state directory owned by another user (see the module docstring).

    A missing directory, or one root owns (a root-run daemon), is fine.
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return
    try:
        owner = os.stat(config.state.dir).st_uid
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CliError(f"state directory {config.state.dir}: {exc.strerror}") from None
    if owner == 0:
        return
    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = f"uid {owner}"
    raise CliError(
        f"refusing to run as root on {config.state.dir}: it belongs to {name}, the daemon's "
        f"user, and files root creates there would be unreadable to it; run the command as "
        f"that user: {ADMIN_WRAPPER} <command> (or runuser -u {name} -- buzz-broker <command>)"
    )


def refuse_unusable_state(config: Config) -> None:
    """CliError if ``[state] dir`` exists and is not a directory (see the module docstring).

    A missing directory is fine (serve and keys init make it); a PermissionError is left
    to `permission_denied`, which names the daemon's user.
    """
    directory = config.state.dir
    try:
        mode = os.stat(directory).st_mode  # follows a symlink: its target is what is used
    except FileNotFoundError:
        return
    except PermissionError:
        raise
    except OSError as exc:  # ENOTDIR (a file on the way), ENAMETOOLONG, ELOOP
        raise CliError(f"[state] dir {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise CliError(f"[state] dir {directory} is not a directory")


def permission_denied(exc: PermissionError, command: str, state_dir: str | None) -> CliError:
    """The one line for a file this user may not use (EACCES, EPERM): an operator's fault
    (the wrong user), not the program's. Only the path and strerror are quoted, never the
    exception's text. Where the path is in the state directory (or unknown, for a command
    that uses one), the remedy is the daemon's user, as `refuse_foreign_state` says."""
    name = exc.filename
    path = os.path.abspath(os.fsdecode(name)) if isinstance(name, (str, bytes)) else None
    where = f"cannot use {path}" if path is not None else f"cannot run {command}"
    line = f"{where}: {exc.strerror or 'permission denied'}"
    state = None if state_dir is None else os.path.abspath(state_dir)
    if state is not None and (path is None or os.path.commonpath([path, state]) == state):
        return CliError(f"{line}; the state directory {state_dir} is the daemon's user's: run "
                        f"the command as that user: {ADMIN_WRAPPER} {command} …")
    return CliError(f"{line}; run the command as a user allowed to, or fix the file's owner "
                    "or mode")


def config_from_args(args: object) -> Config:
    """The configuration a command runs with (the precedence is daemon/config.py's)."""
    from daemon.config import ConfigError, load_config

    try:
        return load_config(getattr(args, "config", None))
    except ConfigError as exc:
        raise CliError(str(exc)) from None



async def open_keys(config: Config) -> Custody:
    """Who holds `config`'s keys, for a command that uses them: the custodian's table when
    `[custody] custodian_socket` is set (from the pipeline's uid: no PIN, no token; the
    client answers the facade's calls), else custody opened in this process. The caller
    closes it (`aclose`)."""
    from custody import Custody

    if config.custody.custodian_socket:
        from custody.custodian.client import CustodianClient

        return await CustodianClient.open(  # type: ignore[return-value]
            Path(config.custody.custodian_socket))
    return await Custody.open(config.pkcs11.token(), Path(config.state.dir),
                              records=config.custody.records())


@contextmanager
def agent_directory(config: Config, fault: str = "{}") -> Iterator[AgentDirectory]:
    """The directory of `config`'s state directory, closed when the block ends. Its key
    records are the custodian's when `[custody] custodian_socket` is set (the keystore is
    not the command's to open, as it is not the daemon's), else the keystore file's. A
    `DirectoryError` leaving the block, or a custodian that does not answer, becomes one
    CliError line: `fault` with `{}` for its message."""
    from custody import CustodyError
    from daemon.state.directory import AgentDirectory, DirectoryError

    socket = config.custody.custodian_socket
    client = None
    if socket:
        from custody.custodian.client import CustodianClient

        client = CustodianClient(Path(socket))
    directory = None
    try:
        # Without a custodian, opening takes a version-1 keystore's names (directory.py).
        directory = AgentDirectory.open(config.state.dir,
                                        None if client is None else client.records)
        yield directory
    except DirectoryError as exc:
        raise CliError(fault.format(exc)) from None
    except CustodyError as exc:  # the custodian's lookups: CustodianUnavailable
        raise CliError(fault.format(f"custodian at {socket}: {exc}")) from None
    finally:
        if directory is not None:
            directory.close()
        if client is not None:
            client.close()
