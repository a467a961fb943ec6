"""A file-level copy of the state directory and the PIN is every agent key (issue 22, Info).

With SoftHSM the token is files: `<state>/softhsm/tokens`, beside the sealed keys, its
secret objects encrypted under the user PIN. So whoever holds a copy of the state
directory and of the PIN file (a whole-host backup of `/var/lib/buzz-broker` and
`/etc/buzz-broker`) can point a SoftHSM of their own at the copy, log in and sign as every
agent, on another machine, with the host gone. docs/install.md ("What a file backup
holds") says so; this test does it: a host made as install.md makes one, copied, the
original removed, and the copy used by a fresh process with its own SoftHSM configuration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.custody._secrets import SECRET_X
from tests.fixtures.token import REPO, make_token

#: Makes its own SoftHSM token, never the session's: the other-token runs deselect it (tests/fixtures/token.py).
pytestmark = pytest.mark.token_independent

OWNER = "f9308a019258c31049344f85f89d5229b531c845836f99b08601f113bce036f9"
LABEL = "file-backup"

_HOST = """
import sys, trio
from custody import Custody, TokenConfig, init_kek
config = TokenConfig(module=sys.argv[1], token_label=sys.argv[2], pin_file=sys.argv[3])
async def main():
    await init_kek(config)
    async with await Custody.open(config, sys.argv[4]) as custody:
        record = await custody.import_agent(bytearray(sys.argv[5].encode()), owner=sys.argv[6])
        print(record.pubkey)
trio.run(main)
"""

_THIEF = """
import sys, trio
from custody import Custody, TokenConfig, UnsignedEvent
from buzzwire.nostr import verify_signed
config = TokenConfig(module=sys.argv[1], token_label=sys.argv[2], pin_file=sys.argv[3])
async def main():
    async with await Custody.open(config, sys.argv[4]) as custody:
        [record] = custody.agents()
        signed = await custody.sign_event(record.pubkey, UnsignedEvent(
            record.pubkey, 1_700_000_000, 1, (), "signed from a copy"))
        print(record.pubkey, verify_signed(signed))
trio.run(main)
"""


def _python(code: str, conf: Path, *args: str) -> str:
    env = dict(os.environ, SOFTHSM2_CONF=str(conf))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_copy_of_state_and_pin_signs_as_every_agent_elsewhere(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    # As install.md: the token under the state directory, the PIN beside the config.
    facts = make_token(host / "softhsm", LABEL)
    module = facts["module"]
    pubkey = _python(_HOST, Path(facts["SOFTHSM2_CONF"]), module, LABEL, facts["pin_file"],
                     str(host / "state"), SECRET_X, OWNER)

    # The file backup: both directories, copied; then the host is gone.
    stolen = tmp_path / "elsewhere"
    shutil.copytree(host, stolen)
    shutil.rmtree(host)
    conf = stolen / "own-softhsm2.conf"
    conf.write_text(f"directories.tokendir = {stolen / 'softhsm' / 'tokens'}\n"
                    "objectstore.backend = file\nlog.level = ERROR\n")
    signed = _python(_THIEF, conf, module, LABEL, str(stolen / "softhsm" / "user-pin"),
                     str(stolen / "state"))
    assert signed == f"{pubkey} True"
