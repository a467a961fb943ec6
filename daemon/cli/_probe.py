"""The deep checks an operator asks for: can this config log in to the token and reach the relay?

Rules:
- Shared by `check-config --deep` and `status`; each check answers a `Check` (name, ok,
  one line of detail) and never raises for the fault it checks: a failed check is an
  answer, not a crash.
- The token check logs in with the configured PIN, finds the KEK and checks its
  attributes (`custody.check_token`), then logs out. The KEK is the one the keystore
  records as active (the rule `keys init` and `Custody.open` follow: after
  `keys rotate` it is not ``[pkcs11] kek_label``), the configured one only where no
  keystore or no rotation is recorded yet; a keystore whose keys `keys migrate` moved to
  another token fails the check, saying to point [pkcs11] at that token. It creates
  nothing: no KEK (that is `keys init`), no keystore. Under a custodian it is the
  custodian's `token` row: custody's same check of the token it is logged in to, made
  now (or within the last second), so a token that went away since it started fails here
  as every signature fails.
- The relay check opens a WebSocket to ``[relay] url`` within ``connect_timeout`` and
  closes it: the relay is reachable and speaks WebSocket. It sends no event and no AUTH
  (no agent key is touched), so a relay that refuses unauthenticated REQs still passes.
- The state check is `serve`'s first step without its lock: as root, a state directory
  another user owns is refused (`_common.refuse_foreign_state`, the rule every
  state command keeps); else the user running the check must be able to create a file in
  it (one is made and removed at once: the real answer, whatever permission bits,
  capabilities or mounts say), or, where it does not exist yet, in the directory `serve`
  would make it in. `check-config --deep` only: `status` reads the state as it is.
- The groups check (only where `[server] socket_group` or `tcp_allow_groups` names a
  group) asks the user database for each name, as `serve` will, and says what each case
  does rather than failing: a socket group that does not exist stops a `serve` that binds
  its own socket, but under socket activation (`buzz-broker.socket`, the installed
  layout) the unit's SocketGroup= applies and the key is not read, and which of the two
  runs is known only at start (as for `tcp:` above); a TCP group that does not exist
  admits its members once it exists (daemon/loopback_tcp.py).
- Details never carry the PIN (custody's messages name files, never their content).
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_websocket

from daemon.cli._common import CliError, refuse_foreign_state
from daemon.config import Config

__all__ = ["Check", "check_token_and_kek", "check_relay", "check_state", "check_groups"]


@dataclass(frozen=True, slots=True)
class Check:
    """One check's answer: `name` (token, relay), `ok`, and one line of `detail`."""

    name: str
    ok: bool
    detail: str


async def check_token_and_kek(config: Config) -> Check:
    """Log in to the configured token, find and check the KEK, log out; where a custodian
    holds the keys, ask it instead (it listens only once it has logged in and found the
    KEK, and this process has neither the PIN nor the token's files)."""
    if config.custody.custodian_socket:
        return await _check_custodian(Path(config.custody.custodian_socket), config.relay.url)
    from custody import CustodyError, check_token  # loads the PKCS#11 binding: not above

    pkcs11 = config.pkcs11
    try:
        active = await check_token(pkcs11.token(), Path(config.state.dir))
    except CustodyError as exc:
        return Check("token", False, str(exc))
    except OSError as exc:  # the state directory is not this user's to read
        return Check("token", False, f"cannot read the keystore in {config.state.dir} "
                     f"({exc.strerror or type(exc).__name__}): run this as the daemon's user")
    rotated = "" if active == pkcs11.kek_label else (
        f" (the active KEK the keystore records, not [pkcs11] kek_label "
        f"{pkcs11.kek_label!r})")
    return Check("token", True, f"logged in to {pkcs11.token_label!r} (PIN from "
                 f"{pkcs11.pin_origin}); KEK {active!r} found and checked{rotated}")


async def _check_custodian(path: Path, relay_url: str | None) -> Check:
    from custody import CustodyError
    from custody.custodian.client import CustodianClient, CustodianUnavailable

    try:
        client = await CustodianClient.open(path)
    except CustodyError as exc:
        return Check("token", False, f"custodian at {path}: {exc}")
    try:
        if relay_url is not None:  # none: the relay check says so
            await client.require_relay(relay_url)
        held = len(client.agents())
        try:
            kek = await client.check_token()
        except CustodianUnavailable:  # not the token's fault: said below as the others
            raise
        except CustodyError as exc:  # it answers, and says why its token does not work
            return Check("token", False, f"the custodian at {path} answers, but its token "
                         f"does not work now: {exc}")
    except CustodyError as exc:
        return Check("token", False, f"custodian at {path}: {exc}")
    finally:
        await client.aclose()
    return Check("token", True, f"the custodian at {path} answers, and its token works (KEK "
                 f"{kek!r} used within the last second, under the custodian's own uid; "
                 f"{held} live agent key{'' if held == 1 else 's'})")


async def check_relay(config: Config) -> Check:
    """Open and close a WebSocket to the relay within its connect timeout."""
    url = config.relay.url
    if url is None:
        return Check("relay", False, "[relay] url is not set")
    timeout = config.relay.connect_timeout
    started = time.monotonic()
    context = ssl.create_default_context() if url.startswith("wss:") else None
    try:
        with trio.fail_after(timeout):
            async with trio_websocket.open_websocket_url(
                url, ssl_context=context, connect_timeout=timeout, disconnect_timeout=1
            ):
                pass
    except trio.TooSlowError:
        return Check("relay", False, f"{url}: no WebSocket within {timeout:g}s")
    except trio_websocket.HandshakeError as exc:
        # trio-websocket wraps a refused or failed TCP connect in HandshakeError too.
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            return Check("relay", False, f"{url}: cannot connect ({_why(cause)})")
        return Check("relay", False, f"{url}: WebSocket handshake failed ({type(exc).__name__})")
    except (OSError, ssl.SSLError, trio.BrokenResourceError) as exc:
        return Check("relay", False, f"{url}: cannot connect ({_why(exc)})")
    elapsed = (time.monotonic() - started) * 1000
    return Check("relay", True, f"{url}: WebSocket opened in {elapsed:.0f} ms")


def _why(exc: BaseException) -> str:
    """The first errno text among `exc` and its causes, else its type's name. trio raises
    a failed connect as an OSError with no errno, its cause a group of one error per
    address tried ("Connection refused" is there): the operator's answer."""
    queue, seen = [exc], set[int]()
    while queue and len(seen) < 64:  # a chain is short; a cycle or a huge group is not read
        current = queue.pop(0)
        seen.add(id(current))
        if isinstance(current, (ssl.SSLError, socket.gaierror)):  # their codes are OpenSSL's
            return str(current.strerror or getattr(current, "reason", None)  # getaddrinfo's
                       or type(current).__name__)
        if isinstance(current, OSError) and current.errno:  # trio's text repeats the address
            return os.strerror(current.errno)
        below = [*(current.exceptions if isinstance(current, BaseExceptionGroup) else ()),
                 current.__cause__ or current.__context__]
        queue += [e for e in below if e is not None and id(e) not in seen]
    return type(exc).__name__


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


async def check_state(config: Config) -> Check:
    """Could `serve`, run as this user, make its files in ``[state] dir``? (module docstring)"""
    directory = Path(config.state.dir)
    try:
        refuse_foreign_state(config)
    except CliError as exc:
        return Check("state", False, str(exc))
    remedy = f"[state] dir must be the daemon's user's to write (this check ran as {_user()})"
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != directory:
        if not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
            return Check("state", False, f"{directory} does not exist and cannot be made in "
                         f"{existing}: {remedy}")
        return Check("state", True, f"{directory} does not exist yet: serve makes it (0700)")
    if not directory.is_dir():
        return Check("state", False, f"{directory} is not a directory")
    probe = directory / f".check-config-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as exc:
        return Check("state", False, f"{directory}: cannot create a file there "
                     f"({exc.strerror}): {remedy}")
    return Check("state", True, f"{directory}: {_user()} can write it")


def _gid_of(group: str) -> int | None:
    if group.isdigit():  # a gid needs no entry: chown(2) and the TCP check take it as is
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


async def check_groups(config: Config) -> Check | None:
    """Do the groups ``[server]`` names exist? None where it names none (module docstring)."""
    server = config.server
    if server.socket_group is None and not server.tcp_allow_groups:
        return None
    said = []
    if server.socket_group is not None:
        gid = _gid_of(server.socket_group)
        said.append(f"socket_group {server.socket_group!r} " + (
            f"is gid {gid}" if gid is not None else "does not exist: a serve that binds its "
            "own socket refuses to start (under buzz-broker.socket, SocketGroup= applies "
            "and this key is not read)"))
    for group in sorted(server.tcp_allow_groups):
        gid = _gid_of(group)
        said.append(f"tcp_allow_groups {group!r} " + (
            "does not exist: admits nobody until it does" if gid is None else f"is gid {gid}"))
    return Check("groups", True, "; ".join(said))
