"""Signatures per second through the custody facade, against coincurve's raw rate.

Run: .venv/bin/python benchmarks/custody.py [--seconds S]

It makes its own SoftHSM2 token with softhsm/make-token in a temporary directory (removed
afterwards), runs `init_kek`, imports one random agent, and measures in one process:
- baseline: coincurve `PrivateKey(secret).sign_schnorr(msg, aux)` on the calling thread,
  no token, no thread hop (the key is a throwaway made for this run);
- facade, sequential: `await custody.sign_event(...)` one at a time (one worker hop each:
  unseal in SoftHSM + re-derive pubkey + BIP-340 + wipe);
- facade, 8 concurrent trio tasks (they queue on the single token worker);
- facade, batched: `sign_events` with 100 events per hop;
- the same three through a custodian process (custody/custodian/, issue 26) on the same token and
  keystore: each call one framed request over its Unix socket, the custodian's intent
  checks, its hash-chained log line per event, then the same facade hop;
- record lookups: in process `custody.agent(...)` (the baseline: SQLite, no socket);
  over the boundary one `agent` request (a blocking round trip), a command's read,
  `client.agent(...)` untended (its snapshot, the version asked at most every 0.25 s by
  the read itself), and the daemon's read, the same call tended (the snapshot only; the
  daemon's task keeps it: custody/custodian/records.py);
- CPU of one 100-event sign in this process: the facade's `sign_events` (the baseline)
  against the custodian's own work on a `sign` request (decode, intent checks, log,
  answer; no socket): CPU time is less moved by other processes than a rate.
Each figure is events/second over a fixed wall-clock window; the ratio is facade/baseline.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import trio  # noqa: E402


def make_token(directory: Path) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, str(REPO / "softhsm" / "make-token"), str(directory), "--label", "bench"],
        capture_output=True, text=True, check=True,
    )
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def rate_sync(fn: Callable[[int], None], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            fn(count)
            count += 1
    return count / (time.perf_counter() - start)


async def rate_async(fn: Callable[[int], Awaitable[int]], seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += await fn(count)
    return count / (time.perf_counter() - start)


async def measure(signer: Any, agent: str, seconds: float) -> tuple[float, float, float]:
    """(sequential, 8 concurrent tasks, 100 per hop) sig/s through `signer` (a `Custody`
    or a `custody.custodian.client.CustodianClient`: the same calls)."""
    from custody import UnsignedEvent

    def event(i: int) -> UnsignedEvent:
        return UnsignedEvent(agent, 1_700_000_000 + i, 9, (("h", "bench"),), f"message {i}")

    async def one(i: int) -> int:
        await signer.sign_event(agent, event(i))
        return 1

    async def eight(i: int) -> int:
        async with trio.open_nursery() as nursery:
            for t in range(8):
                nursery.start_soon(signer.sign_event, agent, event(i + t))
        return 8

    async def batch(i: int) -> int:
        await signer.sign_events([(agent, event(i + k)) for k in range(100)])
        return 100

    return (await rate_async(one, seconds), await rate_async(eight, seconds),
            await rate_async(batch, seconds))


async def bench(facts: dict[str, str], state_dir: Path, seconds: float) -> None:
    from coincurve import PrivateKey

    from custody import Custody, TokenConfig, init_kek

    config = TokenConfig(facts["module"], facts["token_label"], facts["pin_file"], "bench-kek")
    await init_kek(config)
    custody = await Custody.open(config, state_dir)
    try:
        agent = (
            await custody.import_agent(
                bytearray(secrets.token_hex(32).encode()), owner=PrivateKey().public_key_xonly.format().hex())
        ).pubkey
        raw_key = PrivateKey()  # throwaway, not the custody key
        message = bytes(32)

        def raw_sign(i: int) -> None:
            raw_key.sign_schnorr(message, secrets.token_bytes(32))

        baseline = rate_sync(raw_sign, seconds)
        in_process = await measure(custody, agent, seconds)
        local_lookup = rate_sync(lambda i: custody.agent(agent) and None, seconds)
        facade_cpu, custodian_cpu = await cpu_per_request(custody, agent, state_dir, seconds)
    finally:
        await custody.aclose()
    over, (round_trip, snapshot, tended) = await over_the_boundary(config, state_dir, agent,
                                                                   seconds)

    print(f"machine: {os.cpu_count()} cores; SoftHSM2 token; window {seconds:.1f} s per figure")
    print(f"baseline coincurve sign_schnorr (no token, no hop): {baseline:9.0f} sig/s")
    for where, figures in (("facade", in_process), ("custodian", over)):
        for label, value in zip(("sign_event, sequential", "sign_event, 8 trio tasks",
                                 "sign_events, 100 per hop"), figures, strict=True):
            print(f"{where + ' ' + label:<36}: {value:9.0f} sig/s  "
                  f"({value / baseline:.2f} x baseline)")
    print(f"CPU of one 100-event sign, in this process: facade {facade_cpu:6.2f} ms; the "
          f"custodian's decode and answer {custodian_cpu:6.2f} ms "
          f"({custodian_cpu / facade_cpu:.2f} x facade)")
    print(f"record lookup in process (custody.agent, SQLite): {local_lookup:9.0f}/s")
    for label, value in (("custodian `agent` request, blocking round trip", round_trip),
                         ("a command's read over a custodian (untended)", snapshot),
                         ("the daemon's read over a custodian (tended)", tended)):
        print(f"{label:<48}: {value:9.0f}/s  ({value / local_lookup:.2f} x in process)")


async def cpu_per_request(custody: Any, agent: str, state_dir: Path, seconds: float
                          ) -> tuple[float, float]:
    """CPU ms (this process, every thread) of one 100-event sign: the facade's
    `sign_events`, and the custodian's own work on a `sign` request (the frame decoded,
    the intents checked, the log written, the answer encoded: `Custodian.answer`, no
    socket), which noise from other processes moves less than a rate does."""
    from custody.custodian import messages
    from custody.custodian.client import decode_reply, request
    from custody.custodian.server import Custodian, Settings

    from custody import UnsignedEvent

    custodian = Custodian(custody, Settings(
        socket=state_dir.parent / "unused.sock", pipeline_uid=os.getuid(),
        relay_url="ws://127.0.0.1:1", log_path=state_dir.parent / "cpu-log" / "signed.jsonl",
        signatures_per_minute=1_000_000))

    async def facade(i: int) -> None:
        await custody.sign_events([(agent, UnsignedEvent(agent, 1_700_000_000 + i + k, 9,
                                                         (("h", "bench"),), f"m {i + k}"))
                                   for k in range(100)])

    async def answered(i: int) -> None:
        frame = request("sign", events=[
            {"signer": agent, "kind": 9, "created_at": 1_700_000_000 + i + k,
             "tags": [["h", "bench"]], "content": f"m {i + k}"} for k in range(100)])
        answer = await custodian.answer(messages.decode_request(frame[messages.HEADER.size:]))
        assert decode_reply(answer[messages.HEADER.size:])[0], answer[:200]

    figures = []
    for fn in (facade, answered):
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            await fn(count)
            count += 1
        figures.append((time.process_time() - cpu) / count * 1000)
    custodian.log.close()
    return figures[0], figures[1]


async def over_the_boundary(config: Any, state_dir: Path, agent: str, seconds: float
                            ) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The same figures through a custodian process on the same token and keystore."""
    from custody.custodian.client import CustodianClient

    socket = state_dir.parent / "custodian.sock"
    toml = state_dir.parent / "custodian.toml"
    toml.write_text(
        f'[custodian]\nsocket = "{socket}"\nstate_dir = "{state_dir}"\n'
        # The most signatures a minute the configuration allows: the bound never binds here.
        f'relay_url = "ws://127.0.0.1:1"\nsignatures_per_minute = 1000000\n'
        f'[pkcs11]\nmodule = "{config.module}"\ntoken_label = "{config.token_label}"\n'
        f'pin_file = "{config.pin_file}"\nkek_label = "{config.kek_label}"\n')
    errors = state_dir.parent / "custodian.err"  # a file: a pipe nobody reads would fill
    with errors.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "custody.custodian", str(toml)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        if "listening" not in proc.stdout.readline():
            proc.wait()
            # Its one line says why (a configuration this file wrote that it now refuses).
            raise SystemExit(f"the custodian did not start: {errors.read_text().strip()}")
        client = await CustodianClient.open(socket)
        figures = await measure(client, agent, seconds)
        round_trip = rate_sync(lambda i: client.lookup("agent", pubkey=agent,
                                                        include_deleted=False) and None, seconds)
        snapshot = rate_sync(lambda i: client.agent(agent) and None, seconds)
        # As the daemon reads: tended, the snapshot only. Its task is not run here (the
        # window is one synchronous loop); the snapshot is the one just taken.
        client.records.tend()
        tended = rate_sync(lambda i: client.agent(agent) and None, seconds)
        await client.aclose()
    finally:
        proc.terminate()
        proc.wait()
    return figures, (round_trip, snapshot, tended)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="window per figure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="buzz-bench-") as tmp:
        facts = make_token(Path(tmp) / "token")
        os.environ["SOFTHSM2_CONF"] = facts["SOFTHSM2_CONF"]  # before the module is loaded
        trio.run(bench, facts, Path(tmp) / "state", args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
