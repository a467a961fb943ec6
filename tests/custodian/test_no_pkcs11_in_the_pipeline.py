"""Where a custodian holds the keys, the pipeline's code never loads the PKCS#11 binding:
importing the daemon (wiring, the HTTP server, the pipeline, every operation, `serve`)
in a fresh interpreter leaves `pkcs11` out of sys.modules; only `Custody.open`, which the
wiring calls only without `[custody] custodian_socket`, imports it (and so maps the module).
Fails on the code before issue 26's lazy custody surface (custody/__init__.py).

And the pipeline keeps only a small client of the message table: of custody it loads the
errors, the public records, the client and the table (and the keystore's read-only index,
which the directory still reads), never a module that handles a secret nor one of the
commands that run with the daemon stopped (rotation, `keys init`, backup)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PIPELINE = ("daemon.wiring", "daemon.http", "daemon.cli.serve", "daemon.pipeline.broker",
            "daemon.operations", "daemon.state.directory", "custody.custodian.client")


def _loaded(modules: tuple[str, ...], probe: str) -> str:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + probe
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout.strip()


def test_the_pipeline_imports_no_pkcs11_binding() -> None:
    found = _loaded(PIPELINE, "print(sorted(m for m in sys.modules if m.split('.')[0] == "
                              "'pkcs11' or m in ('custody._token', 'custody._facade')))")
    assert found == "[]", found


def test_the_in_process_facade_still_loads_it() -> None:
    assert _loaded(("custody",), "from custody import Custody\n"
                                 "print('pkcs11' in sys.modules)") == "True"


#: Custody's modules that handle a secret, or run only as an operator's command.
NEVER_IN_THE_PIPELINE = ("custody._secret", "custody._secp256k1", "custody._signer",
                         "custody._nip44", "custody._nipae", "custody._sealed",
                         "custody._token", "custody._worker", "custody._cache",
                         "custody._facade", "custody._kekinit", "custody._keys",
                         "custody._rotation", "custody._backup", "custody.custodian.server")


def test_the_pipeline_keeps_only_the_client_of_the_table() -> None:
    found = _loaded(PIPELINE, f"print(sorted(set(sys.modules) & set({NEVER_IN_THE_PIPELINE!r})))")
    assert found == "[]", found
    client = _loaded(PIPELINE, "print(sorted(m for m in sys.modules if m.startswith('custody')))")
    assert "'custody.custodian.client'" in client and "'custody._records'" in client, client
