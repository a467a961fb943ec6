"""Seal and unseal cost per seal kind, and what the unsealed-key cache buys, on one token.

Run: .venv/bin/python benchmarks/seals.py [--seconds S]
     .venv/bin/python benchmarks/seals.py --module M --token-label L --pin-file P [--kinds etm]

Without --module it makes its own SoftHSM2 token with softhsm/make-token in a temporary
directory (removed afterwards). With --module it uses that token as it is (the caller
sets up its environment: SOFTHSM2_CONF, TPM2_PKCS11_*, ...), creating KEKs labelled
`bench-<kind>` where absent (a TPM cannot: make them first, docs/install.md).

Measured in one process, each figure over a fixed wall-clock window:
- baseline: AES-256-GCM open of a 32-byte key on the host (`cryptography`, no token);
- per seal kind: `_sealed.seal` and `_sealed.unseal` (all four defences) looped inside the
  token worker, so the figure is the seal's own cost without the trio thread hop;
- sign_event through the facade, one at a time (thread hop + unseal + BIP-340 + wipe),
  with the unsealed-key cache off and on (one agent, so every call after the first hits),
  in alternating rounds, the median round of each reported.
Each figure is microseconds per operation; ratios are against the baseline (seals) or
against the cache-off rate of the same run (cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
#: Alternating cache-off / cache-on rounds.
ROUNDS = 5

import trio  # noqa: E402


def make_token(directory: Path) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, str(REPO / "softhsm" / "make-token"), str(directory), "--label", "bench"],
        capture_output=True, text=True, check=True,
    )
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def per_op(fn: Callable[[], None], seconds: float) -> float:
    """Mean microseconds per call of `fn` over a `seconds` window."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        count += 10
    return (time.perf_counter() - start) / count * 1e6


async def bench(base: object, state: Path, kinds: list[str], seconds: float) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from custody import CachePolicy, Custody, TokenConfig, UnsignedEvent, init_kek
    from custody._sealed import seal, unseal
    from custody._worker import in_token_worker

    assert isinstance(base, TokenConfig)
    aesgcm, nonce = AESGCM(AESGCM.generate_key(256)), secrets.token_bytes(12)
    host_blob = aesgcm.encrypt(nonce, secrets.token_bytes(32), b"aad")
    baseline = per_op(lambda: aesgcm.decrypt(nonce, host_blob, b"aad") and None, seconds)
    print(f"machine: {os.cpu_count()} cores; token {base.token_label!r} ({base.module}); "
          f"window {seconds:.1f} s per figure")
    print(f"baseline host AES-256-GCM open, 32 bytes (no token): {baseline:9.2f} us/op")

    for kind in kinds:
        config = dataclasses.replace(base, kek_label=f"bench-{kind}", seal=kind)
        await init_kek(config)
        opened = await Custody.open(config, state / kind)
        try:
            agent = (await opened.import_agent(bytearray(secrets.token_hex(32).encode()),
                                               owner="79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798")).pubkey
            token = opened._token
            blob = opened._keystore.sealed_blob(agent)
            assert blob is not None

            def seal_loop() -> float:
                with unseal(token, blob, agent) as secret:
                    return per_op(lambda: seal(token, secret, agent) and None, seconds)

            def unseal_loop() -> float:
                return per_op(lambda: unseal(token, blob, agent).wipe(), seconds)

            sealing = await in_token_worker(seal_loop)
            opening = await in_token_worker(unseal_loop)
        finally:
            await opened.aclose()
        print(f"{kind} seal   : {sealing:9.2f} us/op  ({sealing / baseline:7.1f} x baseline)")
        print(f"{kind} unseal : {opening:9.2f} us/op  ({opening / baseline:7.1f} x baseline)")

    kind = kinds[0]
    config = dataclasses.replace(base, kek_label=f"bench-{kind}", seal=kind)
    # Both at once (the state lock is shared), measured in alternating rounds so that a
    # busy machine's drift falls on both alike; the median round is reported.
    off = await Custody.open(config, state / kind)
    on = await Custody.open(config, state / kind, CachePolicy(16, 60.0))
    try:
        agent = off.agents()[0].pubkey
        event = UnsignedEvent(agent, 1_700_000_000, 9, (("h", "bench"),), "message")
        rounds: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(ROUNDS):
            for name, opened in (("off", off), ("on", on)):
                await opened.sign_event(agent, event)  # the cache's one unseal
                count, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds / ROUNDS:
                    await opened.sign_event(agent, event)
                    count += 1
                rounds[name].append((time.perf_counter() - start) / count * 1e6)
    finally:
        await on.aclose()
        await off.aclose()
    cost = {name: statistics.median(values) for name, values in rounds.items()}
    print(f"sign_event ({kind}), unsealed-key cache off: {cost['off']:9.2f} us/op")
    print(f"sign_event ({kind}), unsealed-key cache on : {cost['on']:9.2f} us/op  "
          f"({cost['off'] / cost['on']:.2f} x as fast as cache off; median of {ROUNDS} "
          "alternating rounds)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="window per figure")
    parser.add_argument("--module", help="an existing token's PKCS#11 module")
    parser.add_argument("--token-label")
    parser.add_argument("--pin-file")
    parser.add_argument("--kinds", default="gcm,etm", help="seal kinds, first one for the cache")
    args = parser.parse_args()
    from custody import TokenConfig

    kinds = [k for k in args.kinds.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="buzz-bench-") as tmp:
        if args.module:
            base = TokenConfig(args.module, args.token_label, args.pin_file)
        else:
            facts = make_token(Path(tmp) / "token")
            os.environ["SOFTHSM2_CONF"] = facts["SOFTHSM2_CONF"]  # before the module loads
            base = TokenConfig(facts["module"], facts["token_label"], facts["pin_file"])
        trio.run(bench, base, Path(tmp) / "state", kinds, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
