"""with-token starts a token, hands the command its variables, and leaves nothing behind.

A token's daemons (swtpm, dbus-daemon, tpm2-abrmd; p11-kit server) are direct children:
after the command they are gone (reaped, not re-parented to PID 1) and so is the temp dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.token import REPO
from tests.tokens import kinds

#: Starts its own tokens, never the session's: the other-token runs deselect it (tests/fixtures/token.py).
pytestmark = pytest.mark.token_independent

WITH_TOKEN = REPO / "tests" / "tokens" / "with-token"
#: Prints the variables a client gets and the pids of its parent's other children.
_REPORT = """
import json, os
ppid = os.getppid()
children = open(f"/proc/{ppid}/task/{ppid}/children").read().split()
print(json.dumps({"env": {k: v for k, v in os.environ.items() if k.startswith("BUZZ_TEST_TOKEN_")
                          or k in ("P11_KIT_SERVER_ADDRESS", "TPM2_PKCS11_STORE")},
                  "siblings": [int(p) for p in children if int(p) != os.getpid()]}))
raise SystemExit(7)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("kind", ["p11kit", "tpm"])
def test_the_token_serves_the_command_and_is_gone_after_it(kind: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUZZ_TEST_TOKEN_")}
    done = subprocess.run([sys.executable, str(WITH_TOKEN), kind, "--", sys.executable, "-c", _REPORT],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 7, done.stderr  # the command's own status
    report = json.loads(done.stdout)
    facts = report["env"]
    assert facts[kinds.ENV_KIND] == kind and facts[kinds.ENV_LABEL] == kinds.TOKEN_LABEL
    assert Path(facts[kinds.ENV_MODULE]).name == Path(kinds.find_module(kinds.KINDS[kind])).name
    daemons = {"p11kit": 1, "tpm": 3}[kind]  # p11-kit server; swtpm, dbus-daemon, tpm2-abrmd
    assert len(report["siblings"]) == daemons
    assert not any(_alive(pid) for pid in report["siblings"])
    assert not Path(facts[kinds.ENV_DIR]).exists()  # PIN files and token store with it


def test_an_unknown_kind_or_no_command_is_refused() -> None:
    unknown = subprocess.run([sys.executable, str(WITH_TOKEN), "hsm9000", "--", "true"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert unknown.returncode == 3 and "unknown token kind" in unknown.stderr
    usage = subprocess.run([sys.executable, str(WITH_TOKEN), "softhsm"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2 and "Usage" in usage.stderr
