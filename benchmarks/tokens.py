"""benchmarks/seals.py on every kind of token, each started fresh by tests/tokens/with-token.

Run: .venv/bin/python benchmarks/tokens.py [--kinds tpm,p11kit,...] [--seconds S]

For each kind (default: softhsm, tpm, opencryptoki, p11kit) it starts a token with no
hardware (the TPM is swtpm; opencryptoki's software token runs in its private namespace),
makes the `bench-etm` KEK pair with `tpm2_ptool` where the token cannot generate keys, and
runs benchmarks/seals.py against it with the seal kinds the token offers
(tests/tokens/kinds.py). The figures and their same-run baselines are seals.py's: this
file only starts tokens, so the measurement lives in one place.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tokens import kinds  # noqa: E402

#: seals.py names its KEKs `bench-<seal kind>`.
ETM_LABEL = "bench-etm"


def inside(seconds: str) -> int:
    """In a with-token environment: make what the operator would, then run seals.py."""
    kind = kinds.KINDS[os.environ[kinds.ENV_KIND]]
    if not kind.offers["GENERATE_KEY"]:
        kinds.add_tpm_keys(ETM_LABEL)
    seals = ["gcm", "etm"] if kind.offers["AES_GCM"] else ["etm"]
    return subprocess.call([
        sys.executable, str(REPO / "benchmarks" / "seals.py"), "--seconds", seconds,
        "--module", os.environ[kinds.ENV_MODULE], "--token-label", os.environ[kinds.ENV_LABEL],
        "--pin-file", os.environ[kinds.ENV_PIN_FILE], "--kinds", ",".join(seals),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(kinds.KINDS))
    parser.add_argument("--seconds", default="1.0", help="window per figure (seals.py)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return inside(args.seconds)
    for name in args.kinds.split(","):
        print(f"== {name} token", flush=True)
        code = subprocess.call([
            sys.executable, str(REPO / "tests" / "tokens" / "with-token"), name, "--",
            sys.executable, str(Path(__file__).resolve()), "--inside", "--seconds", args.seconds,
        ], cwd=REPO)
        if code != 0:
            print(f"benchmarks/tokens.py: the {name} run failed (exit {code})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
