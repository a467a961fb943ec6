"""`read_bounded`, how `keys restore` reads the backup and the age identity (daemon and
custodian alike): the file is checked on the descriptor that is read, with no symlink
followed, only a regular file, no group/other bits where it holds a secret, and no more
than its limit. Every refusal is one line naming the file, never quoting its content.

A mutation review found the symlink, regular-file and size checks guarded by no test
(the mode check was, through `keys restore`): each row below is a file wrong in one way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from custody import CustodyError
from custody._files import read_bounded
from tests.custody._secrets import SECRET_X, assert_no_secrets

#: Opens no session token: the other-token runs deselect it (tests/fixtures/token.py).
pytestmark = pytest.mark.token_independent

LIMIT = 4096
#: What the files hold: an identity's worth of secret text, well under LIMIT.
CONTENT = f"AGE-SECRET-KEY-1{SECRET_X}\n".encode()


def _private(path: Path, content: bytes = CONTENT) -> Path:
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def _symlink(tmp: Path) -> Path:
    link = tmp / "identity-link"
    link.symlink_to(_private(tmp / "identity-target"))
    return link


def _fifo(tmp: Path) -> Path:
    fifo = tmp / "identity-fifo"
    os.mkfifo(fifo, 0o600)
    return fifo


def _loose(tmp: Path) -> Path:
    path = _private(tmp / "identity-loose")
    path.chmod(0o640)
    return path


def _over_limit(tmp: Path) -> Path:
    return _private(tmp / "identity-huge", CONTENT * (LIMIT // len(CONTENT) + 1))


#: A bad file -> (how to make it, the words the refusal names it by).
_BAD: dict[str, tuple[Callable[[Path], Path], str]] = {
    "symlink": (_symlink, "is a symbolic link"),
    "fifo": (_fifo, "is not a regular file"),
    "group/other bits": (_loose, "is readable by group or others"),
    "over the limit": (_over_limit, f"is larger than {LIMIT} bytes"),
    "missing": (lambda tmp: tmp / "absent", "cannot read"),
}


@pytest.mark.parametrize("bad", list(_BAD))
def test_a_bad_file_is_refused_by_what_is_wrong(tmp_path: Path, bad: str) -> None:
    make, words = _BAD[bad]
    path = make(tmp_path)
    with pytest.raises(CustodyError, match=words) as raised:
        read_bounded(path, LIMIT, "identity file", private=True)
    text = f"{raised.value}{raised.value!r}"
    assert str(path) in text and "\n" not in str(raised.value)
    assert_no_secrets(text.encode(), (SECRET_X,))
    assert raised.value.__cause__ is None


def test_a_regular_file_within_its_limit_is_read_whole(tmp_path: Path) -> None:
    exact = _private(tmp_path / "identity", CONTENT + bytes(LIMIT - len(CONTENT)))
    assert read_bounded(exact, LIMIT, "identity file", private=True) == exact.read_bytes()
    # A backup is not a secret to the file system (age encrypts it): group bits are fine.
    shared = _loose(tmp_path)
    assert read_bounded(shared, LIMIT, "backup", private=False) == CONTENT
