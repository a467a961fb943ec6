"""Seal and unseal cost on each kind of token, against the same seal computed in software.

Run: .venv/bin/python benchmarks/tokens.py [--kinds tpm,p11kit,...] [--seconds S]

For each kind it starts a fresh token with tests/tokens/with-token (no hardware: the TPM
is swtpm, opencryptoki's software token runs in its private namespace) and measures, in
one process against that token:
- baseline: the encrypt-then-MAC seal of 32 bytes computed in software with
  `cryptography` (AES-256-CTR + HMAC-SHA256, no token), in this same run;
- unseal: `custody._sealed.unseal` of one agent's blob, N times inside one token-worker
  hop (so no thread hop is counted): the token's MAC check, keystream (or GCM) and the
  pubkey re-derivation;
- seal: `custody._sealed.seal` of that agent's secret, N times in one hop;
- sign: `Custody.sign_event` one at a time, the whole path an agent's post takes through
  custody (one hop, unseal, BIP-340, wipe each).
The seal is the one `keys init` chooses for the token (GCM on SoftHSM, encrypt-then-MAC on
the others). Each figure is the mean over a fixed wall-clock window; ratios are against
the baseline measured in the same child process.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEK_LABEL = "bench-kek"


def mean_ms(fn: Callable[[], None], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return (time.perf_counter() - start) / count * 1000


def software_etm() -> Callable[[], None]:
    import hmac as hmac_module

    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key, mac_key, data = secrets.token_bytes(32), secrets.token_bytes(32), secrets.token_bytes(32)

    def once() -> None:
        nonce = secrets.token_bytes(12)
        encryptor = Cipher(algorithms.AES(key), modes.CTR(nonce + bytes(4))).encryptor()
        ciphertext = encryptor.update(data) + encryptor.finalize()
        hmac_module.digest(mac_key, nonce + ciphertext, "sha256")

    return once


async def measure(seconds: float) -> dict[str, object]:
    """Inside a with-token environment: the figures for its token."""
    from custody import Custody, UnsignedEvent, init_keys
    from custody._sealed import seal, unseal
    from custody._worker import in_token_worker
    from tests.tokens import kinds

    kind = os.environ[kinds.ENV_KIND]
    if not kinds.KINDS[kind].offers["GENERATE_KEY"]:
        kinds.add_tpm_keys(KEK_LABEL)  # before the module is loaded: the operator's step
    from custody import TokenConfig

    config = TokenConfig(os.environ[kinds.ENV_MODULE], os.environ[kinds.ENV_LABEL],
                         os.environ[kinds.ENV_PIN_FILE], KEK_LABEL)
    baseline = mean_ms(software_etm(), seconds)
    with tempfile.TemporaryDirectory(prefix="buzz-bench-") as state:
        report = await init_keys(config, Path(state))
        custody = await Custody.open(config, Path(state))
        try:
            agent = (await custody.import_agent(bytearray(secrets.token_hex(32).encode()),
                                                owner="a" * 64, name="bench")).pubkey
            token = custody._token
            blob = custody._keystore.sealed_blob(agent)
            assert blob is not None

            def unseal_once() -> None:
                with unseal(token, blob, agent):
                    pass

            def in_hop(fn: Callable[[], None]) -> Callable[[], float]:
                return lambda: mean_ms(fn, seconds)

            unseal_ms = await in_token_worker(in_hop(unseal_once))

            def seal_window() -> float:
                with unseal(token, blob, agent) as secret:
                    def seal_once() -> None:
                        seal(token, secret, agent)

                    return mean_ms(seal_once, seconds)

            seal_ms = await in_token_worker(seal_window)
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                await custody.sign_event(agent, UnsignedEvent(agent, 1_700_000_000 + count, 9,
                                                              (("h", "bench"),), "m"))
                count += 1
            sign_ms = (time.perf_counter() - start) / count * 1000
        finally:
            await custody.aclose()
    return {"kind": kind, "seal": report.seal, "baseline_ms": baseline, "unseal_ms": unseal_ms,
            "seal_ms": seal_ms, "sign_ms": sign_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="softhsm,tpm,opencryptoki,p11kit")
    parser.add_argument("--seconds", type=float, default=1.0, help="window per figure")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        import trio

        print(json.dumps(trio.run(measure, args.seconds)))
        return 0
    print(f"machine: {os.cpu_count()} cores; window {args.seconds:.1f} s per figure; "
          "baseline: the encrypt-then-MAC seal in software (cryptography), same process")
    print(f"{'token':<13}{'seal':<6}{'baseline':>10}{'unseal':>10}{'seal':>10}{'sign_event':>12}"
          f"{'unseal/baseline':>17}")
    for kind in args.kinds.split(","):
        done = subprocess.run(
            [sys.executable, str(REPO / "tests" / "tokens" / "with-token"), kind, "--",
             sys.executable, str(Path(__file__).resolve()), "--inside",
             "--seconds", str(args.seconds)],
            capture_output=True, text=True, cwd=REPO, check=False, timeout=600,
        )
        if done.returncode != 0:
            print(f"{kind}: failed: {done.stderr.strip().splitlines()[-1:]}")
            return 1
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{kind:<13}{r['seal']:<6}{r['baseline_ms'] * 1000:>8.1f}µs"
              f"{r['unseal_ms']:>8.3f}ms{r['seal_ms']:>8.3f}ms{r['sign_ms']:>10.3f}ms"
              f"{r['unseal_ms'] / r['baseline_ms']:>16.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
