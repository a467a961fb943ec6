"""Where the broker is and which credential to show it, from arguments or the environment.

Rules:
- Precedence, each item decided alone: an explicit argument, then the environment
  (`BUZZ_BROKER_SOCKET`; `BUZZ_BROKER_CREDENTIAL` *or* `BUZZ_BROKER_CREDENTIAL_FILE`), then,
  for the address only, the broker's default socket path. There is no default credential.
- Both credential variables set at once is refused rather than ranked: a harness that sets
  both has a mistake in it, and guessing would hide which credential the agent runs with.
- A credential file is read once, bounded (`MAX_CREDENTIAL_FILE_BYTES`), ASCII, trimmed.
  A file readable by group or others is reported back (`CredentialFile.loose_mode`) so the
  caller can warn; it is not refused (the file may live on a mount that cannot express
  modes). Error messages name the file and the fix, never its contents, and never a
  "path" that looks like a credential itself (`_shown_path`): a harness that put the token
  where its file goes would otherwise see it in a message it logs. The socket address is
  shown through the same guard (`_transport.Endpoint.describe`).
- No frame of this package on the traceback of an error raised while the client is built
  or its credential read holds the credential: crash reporters render every frame's
  locals (Sentry, `pytest --showlocals`, traceback's `capture_locals`), and an agent that
  handed over only a file or the environment has the token in no frame of its own. So
  what can be checked without the credential is checked before it is read; a problem with
  it is decided by a helper that returns only a message or an error to raise
  (`_content_problem`, `_transport.credential_refusal`); the secret is dropped (`del`)
  before the raise; and
  the environment is read one variable at a time (`_variable`), never bound to a name
  (`os.environ` holds `$BUZZ_BROKER_CREDENTIAL`).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from ._errors import CREDENTIAL_ENV, CREDENTIAL_FILE_ENV, SOCKET_ENV, NotConfigured

__all__ = [
    "DEFAULT_SOCKET",
    "MAX_CREDENTIAL_FILE_BYTES",
    "CredentialFile",
    "read_credential_file",
    "resolve_address",
    "resolve_credential",
]

#: The broker's own default `server.socket` (docs/configuration.md).
DEFAULT_SOCKET = "/run/buzz-broker/broker.sock"

#: Bound on a credential file: a session credential is a short token.
MAX_CREDENTIAL_FILE_BYTES = 4096

#: The broker's session tokens are `bzb_` and 43 base64url characters
#: (daemon/state/sessions.py, not imported: the client stands alone). Twenty of them are
#: enough to be a secret worth hiding, and far more than a file name's `bzb_` prefix.
_CREDENTIAL_LIKE = re.compile(r"bzb_[A-Za-z0-9_-]{20,}")


@dataclass(frozen=True, slots=True)
class CredentialFile:
    """A credential read from a file. `loose_mode` is the file's mode when group or others
    may read it (the caller warns), else None."""

    value: str = field(repr=False)
    loose_mode: int | None


def _shown_path(path: str) -> str:
    """`path` as error messages name it: not at all when it looks like a credential."""
    if _CREDENTIAL_LIKE.search(path):
        return "(not shown: it looks like a credential, not a path)"
    return path


def read_credential_file(path: str) -> CredentialFile:
    """Read one credential file.

    Raises:
        NotConfigured: missing, not a regular file, unreadable, too large, not ASCII, or
            empty.
    """
    shown = _shown_path(path)
    try:
        # O_NONBLOCK: a FIFO put where the file goes cannot hang the open; the read below is
        # only of a regular file (checked on the open descriptor).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as handle:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotConfigured(f"credential file {shown} is not a regular file (a "
                                    "directory, FIFO, socket or device); name the file itself")
            raw = handle.read(MAX_CREDENTIAL_FILE_BYTES + 1)
    except FileNotFoundError:
        if shown != path:
            raise NotConfigured(
                f"the credential file path looks like a credential itself, not a path (so it "
                f"is not shown): put the credential in a file only the agent's user can read "
                f"(mode 0400) and set ${CREDENTIAL_FILE_ENV}, or pass the path, to that "
                f"file") from None
        raise NotConfigured(f"cannot read credential file {path}: there is no such file; "
                            f"check ${CREDENTIAL_FILE_ENV} or the path you passed") from None
    except PermissionError:
        raise NotConfigured(f"cannot read credential file {shown}: permission denied; it must "
                            "be owned by (and readable only by) the agent's user, mode 0400") from None
    except OSError as exc:
        raise NotConfigured(f"cannot read credential file {shown}: {exc.strerror}") from None
    problem = _content_problem(raw)
    if problem is not None:
        del raw  # before the raise (module docstring)
        raise NotConfigured(f"credential file {shown} {problem}")
    loose = stat.S_IMODE(mode) if mode & (stat.S_IRWXG | stat.S_IRWXO) else None
    return CredentialFile(value=raw.decode("ascii").strip(), loose_mode=loose)


def _content_problem(raw: bytes) -> str | None:
    """What makes a credential file's bytes unusable, as the rest of a sentence that names
    the file, or None. Only a message: the caller drops the bytes before it raises."""
    if len(raw) > MAX_CREDENTIAL_FILE_BYTES:
        return "is too large to be a credential"
    if not raw.isascii():
        return "does not hold an ASCII credential"
    if not raw.decode("ascii").strip():
        return "is empty"
    return None


def _variable(name: str) -> str:
    """The environment variable `name`, trimmed ("" when unset)."""
    return os.environ.get(name, "").strip()


def resolve_address(address: str | None) -> str:
    """The broker address: `address`, else `$BUZZ_BROKER_SOCKET`, else the default socket."""
    if address is not None:
        return address
    return _variable(SOCKET_ENV) or DEFAULT_SOCKET


def resolve_credential(
    credential: str | None, credential_file: str | None, *,
    file_option: str = "credential_file=",
) -> tuple[str, CredentialFile | None]:
    """The credential, and the file it came from when it came from one.

    Args:
        credential: the credential itself, when the caller was handed it.
        credential_file: the file holding it, when the caller was handed that.
        file_option: how the caller's own user passes `credential_file`, as the "no
            credential" message names it: this keyword for Python, a flag for a command
            line (`buzz-broker call` passes `--credential-file FILE`).

    Raises:
        NotConfigured: none given and none in the environment; both given; both variables
            set; or the file cannot be used (see `read_credential_file`).
    """
    if credential is not None:
        if credential_file is not None:
            del credential  # before the raise (module docstring)
            raise NotConfigured("pass credential= or credential_file=, not both")
        return credential, None
    if credential_file is not None:
        read = read_credential_file(credential_file)
        return read.value, read
    # Both variables set is decided before the credential's is read (module docstring).
    path = _variable(CREDENTIAL_FILE_ENV)
    if path and _variable(CREDENTIAL_ENV):
        raise NotConfigured(f"both ${CREDENTIAL_ENV} and ${CREDENTIAL_FILE_ENV} are set; "
                            "set only one")
    if path:
        read = read_credential_file(path)
        return read.value, read
    value = _variable(CREDENTIAL_ENV)
    if value:
        return value, None
    raise NotConfigured(f"no credential: set ${CREDENTIAL_FILE_ENV} to the file the operator "
                        f"handed this agent (or ${CREDENTIAL_ENV}), or pass {file_option}")
