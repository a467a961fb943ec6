"""The PIN file is checked on the descriptor that is read: no symlink, no FIFO, mode 600,
owned by us or root, of a PIN's size. Every refusal is one line that never quotes the PIN.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from custody import Custody, CustodyError
from tests.fixtures.token import SoftHsmToken

NOBODY = 65534


def _copy(real: Path, where: Path) -> Path:
    where.write_bytes(real.read_bytes())
    where.chmod(0o600)
    return where


def _symlink(real: Path, tmp: Path) -> Path:
    link = tmp / "pin-link"
    link.symlink_to(_copy(real, tmp / "pin-target"))
    return link


def _fifo(_real: Path, tmp: Path) -> Path:
    fifo = tmp / "pin-fifo"
    os.mkfifo(fifo, 0o600)
    return fifo


def _foreign_owner(real: Path, tmp: Path) -> Path:
    path = _copy(real, tmp / "pin-foreign")
    os.chown(path, NOBODY, NOBODY)
    return path


def _loose(real: Path, tmp: Path) -> Path:
    path = _copy(real, tmp / "pin-loose")
    path.chmod(0o604)
    return path


def _huge(real: Path, tmp: Path) -> Path:
    path = tmp / "pin-huge"
    path.write_bytes(real.read_bytes().strip() * 200)
    path.chmod(0o600)
    return path


def _empty(_real: Path, tmp: Path) -> Path:
    path = tmp / "pin-empty"
    path.write_bytes(b"\n")
    path.chmod(0o600)
    return path


#: A bad PIN file -> (how to make it, the words the refusal names it by).
_BAD: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "symlink": (_symlink, "symbolic link"),
    "fifo": (_fifo, "not a regular file"),
    "foreign owner": (_foreign_owner, "owned by uid 65534"),
    "group/other bits": (_loose, "readable by group or others"),
    "too long": (_huge, "longer than"),
    "empty": (_empty, "is empty"),
    "missing": (lambda _real, tmp: tmp / "absent", "cannot read"),
}


@pytest.mark.parametrize("bad", list(_BAD))
async def test_a_bad_pin_file_is_refused_by_what_is_wrong(
    softhsm_token: SoftHsmToken, tmp_path: Path, bad: str
) -> None:
    if bad == "foreign owner" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    real = Path(softhsm_token.pin_file)
    make, words = _BAD[bad]
    pin_file = make(real, tmp_path)
    with pytest.raises(CustodyError, match=words) as raised:
        await Custody.open(softhsm_token.config(pin_file=str(pin_file)), tmp_path / "state")
    pin = real.read_text().strip()
    assert pin not in f"{raised.value}{raised.value!r}" and raised.value.__cause__ is None


@pytest.mark.token_offers("GENERATE_KEY")
async def test_a_pin_file_owned_by_us_with_mode_400_and_crlf_opens(
    softhsm_token: SoftHsmToken, tmp_path: Path
) -> None:
    from custody import init_kek

    real = Path(softhsm_token.pin_file)
    pin_file = tmp_path / "pin-400"
    pin_file.write_bytes(real.read_bytes().strip() + b"\r\n")
    pin_file.chmod(0o400)
    config = softhsm_token.config(pin_file=str(pin_file), kek_label="pin-file-ok")
    assert await init_kek(config) is True
    opened = await Custody.open(config, tmp_path / "state")
    await opened.aclose()
