"""Root running the custodian's own commands (or the custodian itself) on directories the
custodian's user owns is refused before anything is written, as the daemon's commands are
on its state directory (daemon/cli/_common.py `refuse_foreign_state`): SoftHSM objects,
keystore.db, custody.lock and signed.jsonl made by root are 0600 root, and the custodian
could no longer open them (custody/custodian/main.py `refuse_foreign_state`).

The directories checked: `state_dir`, the signed log's directory, the SoftHSM token
directory SOFTHSM2_CONF names, each or (missing) its nearest existing parent. The
reviewer's layout: those owned by nobody, the PIN file root's (root can read it), the
command run as root through `buzz-broker custodian FILE` (the unit's ExecStart) and
`python -m custody.custodian FILE`.

Needs root (skipped otherwise). A fresh SoftHSM token of its own: token_independent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.token import make_token

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
pytestmark = [pytest.mark.token_independent, pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the refusal is root's, on another uid's files")]
ENTRY_POINTS = {"buzz-broker custodian": ["daemon.cli", "custodian"],
                "python -m custody.custodian": ["custody.custodian"]}


def _owners(top: Path) -> dict[str, int]:
    return {str(p): p.lstat().st_uid for p in [top, *top.rglob("*")]} if top.exists() else {}


class Layout:
    def __init__(self, tmp: Path) -> None:
        facts = make_token(tmp / "softhsm", label="foreign")
        self.env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
        self.env["SOFTHSM2_CONF"] = facts["SOFTHSM2_CONF"]
        self.dirs = {"token": tmp / "softhsm" / "tokens", "state": tmp / "home" / "state",
                     "log": tmp / "log", "parent": tmp / "home"}
        self.dirs["state"].mkdir(parents=True)
        self.dirs["log"].mkdir()
        pin = tmp / "pin"  # root's, as the reviewer's: root reads it, that is no fault
        shutil.copyfile(facts["pin_file"], pin)
        pin.chmod(0o600)
        self.config = tmp / "custodian.toml"
        self.config.write_text(
            f'[custodian]\nsocket = "{tmp / "c.sock"}"\nstate_dir = "{self.dirs["state"]}"\n'
            f'log_dir = "{self.dirs["log"]}"\nrelay_url = "ws://127.0.0.1:1"\n'
            f'[pkcs11]\nmodule = "{facts["module"]}"\ntoken_label = "foreign"\n'
            f'pin_file = "{pin}"\n')

    def run(self, entry: str, *words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *ENTRY_POINTS[entry], str(self.config),
                               *words], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=30)

    def give_away(self, which: str) -> Path:
        top = self.dirs[which]
        if which == "parent":
            shutil.rmtree(self.dirs["state"])  # missing: root would make it, and root's
        for path in [top, *top.rglob("*")]:
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        return top


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("which, words, kek", [
    ("token", ["keys", "init"], False),  # would make the KEK's objects in nobody's token
    ("state", ["keys", "init"], False),
    ("state", ["keys", "rotate"], True),  # keystore.db, custody.lock
    ("log", ["keys", "rotate"], True),  # signed.jsonl, destroyed/
    ("parent", ["keys", "rotate"], True),  # state_dir missing under nobody's directory
    ("state", [], True),  # serving: keystore.db
], ids=["token-init", "state-init", "state-rotate", "log-rotate", "parent-rotate", "state-serve"])
def test_root_is_refused_on_the_custodians_directories_and_writes_nothing(
        tmp_path: Path, entry: str, which: str, words: list[str], kek: bool) -> None:
    layout = Layout(tmp_path)
    if kek:  # made while every directory is root's: allowed, and the control
        made = layout.run(entry, "keys", "init")
        assert made.returncode == 0, made.stderr
    top = layout.give_away(which)
    before = {path: layout.dirs[path] for path in ("token", "state", "log")}
    owners = {name: _owners(path) for name, path in before.items()}
    done = layout.run(entry, *words)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"refusing to run as root on {top}: it belongs to nobody" in lines[0], lines[0]
    assert "buzz-custodian-admin" in lines[0] and "runuser -u nobody" in lines[0]
    assert {name: _owners(path) for name, path in before.items()} == owners, "nothing written"
