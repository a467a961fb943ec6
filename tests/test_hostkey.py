"""daemon/hostkey: the state directory's host keys, for both of their users.

The read-cursor MAC key (`cursor-mac.key`, daemon/relay/cursor.py) and the audit log's body
MAC key (`audit-mac.key`, daemon/state/audit_mac.py) are made and read by the one module:
made once, 0600 whatever the umask, never remade; a file of the wrong size, a file group
or other can read, anything but a regular file, or a directory where none can be made is
refused with one `HostKeyError` naming the key and its path, and the file is left as it was.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from custody import TokenConfig
from daemon.hostkey import HOST_KEY_BYTES, HostKeyError, load_or_create
from daemon.relay import cursor
from daemon.state import audit_mac

#: (how the daemon opens it, its file name, what its messages call it)
USERS = [
    pytest.param(cursor.CursorCodec.open, cursor.KEY_FILE_NAME, "cursor MAC key", id="cursor"),
    pytest.param(audit_mac.BodyMac.open, audit_mac.KEY_FILE_NAME, "audit MAC key", id="audit"),
]


@pytest.mark.parametrize(("opener", "name", "what"), USERS)
def test_made_once_private_and_kept(tmp_path: Path, opener: Callable[[Path], object],
                                    name: str, what: str) -> None:
    old = os.umask(0)
    try:
        opener(tmp_path)
    finally:
        os.umask(old)
    key = tmp_path / name
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.stat().st_size == HOST_KEY_BYTES
    assert os.listdir(tmp_path) == [name]  # no temporary left behind
    first = key.read_bytes()
    opener(tmp_path)
    assert key.read_bytes() == first  # read again, not made again


def test_the_two_keys_are_two_files_and_the_body_mac_is_stable(tmp_path: Path) -> None:
    cursor.CursorCodec.open(tmp_path)
    body_mac = audit_mac.BodyMac.open(tmp_path)
    keys = {name: (tmp_path / name).read_bytes()
            for name in (cursor.KEY_FILE_NAME, audit_mac.KEY_FILE_NAME)}
    assert len(set(keys.values())) == 2
    again = audit_mac.BodyMac.open(tmp_path)  # a restart: same bytes, same MAC
    assert again.of(b"{}") == body_mac.of(b"{}") != body_mac.of(b"{} ")
    key = keys[audit_mac.KEY_FILE_NAME]
    assert key.hex() not in repr(body_mac) and "redacted" in repr(body_mac)


def _short(path: Path) -> None:
    path.write_bytes(b"k" * (HOST_KEY_BYTES - 1))
    os.chmod(path, 0o600)


def _long(path: Path) -> None:
    path.write_bytes(b"k" * (HOST_KEY_BYTES + 1))
    os.chmod(path, 0o600)


def _empty(path: Path) -> None:
    path.write_bytes(b"")
    os.chmod(path, 0o600)


def _group_readable(path: Path) -> None:
    path.write_bytes(b"k" * HOST_KEY_BYTES)
    os.chmod(path, 0o640)


def _world_readable(path: Path) -> None:
    path.write_bytes(b"k" * HOST_KEY_BYTES)
    os.chmod(path, 0o604)


def _directory(path: Path) -> None:
    path.mkdir(mode=0o700)


def _fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)  # opening it to read would wait for a writer forever


def _symlink(path: Path) -> None:
    real = path.with_name("elsewhere")
    real.write_bytes(b"k" * HOST_KEY_BYTES)
    os.chmod(real, 0o600)
    path.symlink_to(real)


def _dangling_symlink(path: Path) -> None:
    path.symlink_to(path.with_name("nowhere"))


#: spoil -> (how the key file is spoiled, what the refusal says)
SPOILS = {"short": (_short, "exactly 32 bytes"), "long": (_long, "exactly 32 bytes"),
          "empty": (_empty, "exactly 32 bytes"),
          "group-readable": (_group_readable, "readable by others; chmod 600"),
          "world-readable": (_world_readable, "readable by others; chmod 600"),
          "directory": (_directory, "not a regular file"),
          "fifo": (_fifo, "not a regular file"),
          "symlink": (_symlink, "cannot open"),
          "dangling-symlink": (_dangling_symlink, "cannot open")}


def _state(path: Path) -> tuple[int, bytes | None, str | None]:
    info = os.lstat(path)
    data = path.read_bytes() if stat.S_ISREG(info.st_mode) else None
    target = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
    return info.st_mode, data, target


@pytest.mark.parametrize(("opener", "name", "what"), USERS)
@pytest.mark.parametrize("spoil", sorted(SPOILS))
def test_an_unusable_key_file_is_refused_and_left_as_it_was(
    tmp_path: Path, opener: Callable[[Path], object], name: str, what: str, spoil: str,
) -> None:
    make, said = SPOILS[spoil]
    path = tmp_path / name
    make(path)
    before = _state(path)
    with pytest.raises(HostKeyError) as raised:
        opener(tmp_path)
    message = str(raised.value)
    assert said in message and f"the {what} {path}" in message, message
    assert _state(path) == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(("opener", "name", "what"), USERS)
def test_a_directory_where_none_can_be_made_is_refused(
    tmp_path: Path, opener: Callable[[Path], object], name: str, what: str,
) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(HostKeyError, match=f"cannot create the {what} in {missing}"):
        opener(missing)


def test_racing_first_uses_end_with_one_key(tmp_path: Path) -> None:
    """Made under a private name and linked into place: racers agree on one key."""
    start = threading.Barrier(16)
    keys: list[bytes] = []

    def first_use() -> None:
        start.wait()
        keys.append(load_or_create(tmp_path, "race.key", what="test key"))

    threads = [threading.Thread(target=first_use) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(keys) == 16 and len(set(keys)) == 1
    assert (tmp_path / "race.key").read_bytes() == keys[0]
    assert os.listdir(tmp_path) == ["race.key"]


@pytest.mark.parametrize(("name", "what"), [
    (cursor.KEY_FILE_NAME, "cursor MAC key"), (audit_mac.KEY_FILE_NAME, "audit MAC key")],
    ids=["cursor", "audit"])
async def test_an_unusable_key_stops_the_start_with_one_line(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path, name: str, what: str,
) -> None:
    """The daemon opens both keys at start (daemon/wiring.py): a refused one is its one
    line for the operator, before anything is served."""
    from daemon.config import load_config
    from daemon.wiring import StartupError, running
    from tests.fixtures.broker import write_config

    token, state_dir = custody_state
    state_dir.mkdir(mode=0o700, exist_ok=True)
    _group_readable(state_dir / name)
    config = load_config(str(write_config(
        tmp_path / "broker.toml", token=token, state_dir=state_dir,
        socket=tmp_path / "broker.sock", relay_url="ws://127.0.0.1:9")))
    with pytest.raises(StartupError) as raised:
        async with running(config):
            pass
    message = str(raised.value)
    assert message == (f"state directory {state_dir}: the {what} {state_dir / name} is "
                       "readable by others; chmod 600 it")
