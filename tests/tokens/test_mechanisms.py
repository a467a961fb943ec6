"""What the session's token offers, tried for real, against the field lab's table (`KINDS`).

Runs on whichever token the session has: SoftHSM2 in the main suite, each other kind in
the four-token run (`make test`, tests/tokens/with-token). The probe runs in a subprocess
(`tests.tokens.probe`): python-pkcs11 allows one login per process. What it saw is
recorded as a `token_offers` property in the JUnit report (`--junitxml`) and printed with -s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fixtures.token import REPO, SoftHsmToken
from tests.tokens import kinds


def _probe_environment(token: SoftHsmToken) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        kinds.ENV_KIND: token.kind,
        kinds.ENV_MODULE: token.module,
        kinds.ENV_LABEL: token.label,
        kinds.ENV_PIN_FILE: token.pin_file,
        "PYTHONPATH": str(REPO),
    })
    if token.conf is not None:
        env["SOFTHSM2_CONF"] = token.conf
    return env


def test_token_offers_what_the_field_lab_measured(
    softhsm_token: SoftHsmToken, record_property: pytest.RecordProperty
) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.tokens.probe"],
                          env=_probe_environment(softhsm_token), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    record_property("token_offers", json.dumps(seen["offers"], sort_keys=True))
    print(f"{softhsm_token.kind}: {seen['offers']}")
    assert seen["kind"] == softhsm_token.kind
    assert seen["offers"] == dict(kinds.KINDS[softhsm_token.kind].offers)
    # Every token offers the portable seal's two operations (the encrypt-then-MAC seal).
    assert seen["offers"]["AES_ECB"] and seen["offers"]["SHA256_HMAC"]


@pytest.mark.token_independent
def test_makefile_installs_every_token_package() -> None:
    # CI starts from a clean machine: `make test` must install what each kind needs.
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    listed: set[str] = set()
    for line in makefile.splitlines():
        if line.startswith(("APT_PACKAGES :=", "TOKEN_PACKAGES :=")):
            listed |= set(line.split(":=", 1)[1].split())
    for kind in kinds.KINDS.values():
        assert set(kind.packages) <= listed, (kind.name, set(kind.packages) - listed)
