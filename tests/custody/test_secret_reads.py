"""`read_limited`, the one reader of secret text from a descriptor (an agent's key for
`agent import`, the PIN, an age identity), leaves no copy of what it read in memory it
lets go, whichever way the read ends (custody/_secret.py: "read straight into one
bytearray ... zeroed afterwards").

A review of custody's secret handling found two ways it did (each shown here in a child
process that records the address of the buffer the read went into, then, once the
caller has zeroed what it got back, looks at what is left at that address):
- the buffer, 257 bytes for a secret line, was cut to the bytes read with `del`, which
  CPython's small-object allocator may do by moving the contents to a smaller block and
  freeing the old one as it is: hex digits 9 to 64 of the key stayed there (the other 32
  bits are a brute force against the public key away);
- a read interrupted after the line (Ctrl-C instead of Ctrl-D at the prompt) dropped the
  buffer unzeroed.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

#: Opens no session token: the other-token runs deselect it (tests/fixtures/token.py).
pytestmark = pytest.mark.token_independent

REPO = Path(__file__).resolve().parents[2]

#: The child: reads its stdin as `agent import` does, recording the address of the buffer
#: the first readv fills (a pass-through wrapper: it copies nothing), then prints what is
#: at that address once the caller's copy is zeroed. Bytes 0-7 of a freed small block
#: hold the allocator's free-list link: the look starts at 8.
CHILD = r"""
import ctypes, gc, os, signal, sys
import custody._secret as module
from custody._files import read_secret_text
from custody._secret import parse_secret_text

first = []
readv = os.readv

class Os:
    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def readv(fd, buffers):
        if not first:
            first.append(ctypes.addressof((ctypes.c_char * 1).from_buffer(buffers[0])))
        return readv(fd, buffers)

module.os = Os()
if sys.argv[1] == "interrupted":
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)
    try:
        read_secret_text(0)
    except KeyboardInterrupt:
        pass
else:
    text = read_secret_text(0)
    with parse_secret_text(text):
        pass
    assert not any(text)
gc.collect()
print(ctypes.string_at(first[0] + 8, 56).hex())
"""


def _left_behind(how: str, line: bytes) -> bytes:
    """What the child finds, once done, where its read of `line` went."""
    read, write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", CHILD, how], stdin=read,
                             stdout=subprocess.PIPE, cwd=REPO, env={**os.environ,
                                                                    "PYTHONPATH": str(REPO)})
    os.close(read)
    os.write(write, line)
    if how != "interrupted":  # else the pipe stays open: the operator never sent Ctrl-D
        os.close(write)
    out, _ = child.communicate(timeout=60)
    if how == "interrupted":
        os.close(write)
    assert child.returncode == 0
    return bytes.fromhex(out.decode().strip())


@pytest.mark.parametrize("how", ["whole", "interrupted"])
def test_secret_text_read_leaves_no_copy_where_it_was_read(how: str) -> None:
    key = secrets.token_hex(32).encode()
    left = _left_behind(how, key + b"\n")
    assert key[8:] not in left and key[8:40] not in left, (how, left)
