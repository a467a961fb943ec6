"""A plaintext the pipeline handled, and the credential that asked for it, live only within
that request (issue 26): once the requests have returned and the memory they used has been
freed and reused, neither the daemon's nor the custodian's memory holds them, under the
systemd units' environment. docs/custodian.md, "What stays in the custodian's memory", and
daemon/cli/__init__.py's main.

What is driven: `storage.put` of a random value under a random slug, `storage.get` of it
(NIP-AE: the custodian, or custody in process, encrypts and decrypts it), `observer.emit`
of a random payload, each with the agent's bearer credential; then CHURN unrelated
requests under another credential, so the small blocks the three requests freed are taken
again and written over by the allocator's reuse as well as by its free. Then the whole
readable memory of each process is scanned (/proc/<pid>/mem, tests/fixtures/memscan.py)
for the value, the slug, the payload and the credential. In both custody modes: custody
in the daemon's process, and through the custodian (docs/custodian.md).

Each process runs with the test's environment plus its unit's `Environment=` lines
(tests/fixtures/units.py: read from systemd/buzz-broker.service and
buzz-custodian.service, not written here). What makes it pass is the units' allocator
settings: `harden_process` (custody/_process.py) has glibc fill each chunk as it frees it
(M_PERTURB), but glibc's per-thread cache (tcache, chunks of 1,032 usable bytes or fewer)
and CPython's small-object allocator (pymalloc, 512 bytes or fewer) free without it, and
that is where the HTTP body, the parsed strings, the NIP-AE body and the JSON answer
live. PYTHONMALLOC=malloc sends CPython's small objects to glibc, and
GLIBC_TUNABLES=glibc.malloc.tcache_count=0 empties the cache, so every free is filled.
Without the two lines in the units this test fails: the scan finds the value, the slug,
the payload and, in some runs, the credential, in both processes (shown when the fix was
made: see CHANGELOG).

Reading the memory needs root for the custodian and for a daemon that opened custody
(both make themselves undumpable); skipped, saying why, where it cannot be read.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import trio

from custody import TokenConfig
from daemon.state.sessions import SessionStore
from tests.adversarial._daemon import REPO, envelope, post, request_body, setup_state
from tests.fixtures.broker import write_config
from tests.fixtures.custodian import CustodianProcess, write_custodian_config
from tests.fixtures.memscan import memory_hits, readable_reason
from tests.fixtures.units import BROKER_UNIT, CUSTODIAN_UNIT, unit_environment

CHANNEL = "0b6f6a1e-0000-4000-8000-00000000001a"
#: Unrelated requests after the three: the reviewer's reproduction used 1,000; 300 found
#: the same residue here in every run without the units' settings, in a third of the time.
CHURN = 300
#: Padding of the stored value: a few hundred bytes puts its blocks in glibc's per-thread
#: cache sizes as well as pymalloc's, where the residue was found.
PAD = 600
#: The daemon logs this once it serves (daemon/cli/serve.py).
READY = '"event":"serve.ready"'
START_SECONDS = 30.0


@contextmanager
def _daemon(config: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`buzz-broker serve` as its unit runs it, ready; SIGTERM on the way out."""
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    env |= unit_environment(BROKER_UNIT)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config", str(config),
                                 "serve"], cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, env=env)
    try:
        deadline = time.monotonic() + START_SECONDS
        while READY not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("through_custodian", [False, True], ids=["in-process", "custodian"])
def test_no_plaintext_or_credential_outlives_its_request(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path,
        through_custodian: bool) -> None:
    token, state = custody_state
    agent = trio.run(setup_state, token, state, [CHANNEL])
    store = SessionStore.open(state)
    try:
        _, churn_credential = store.issue(
            agent=agent.agent, channels=frozenset([CHANNEL]),
            actions=frozenset(["storage.address"]), ttl_seconds=None, uid=None,
            now=int(time.time()))
    finally:
        store.close()
    value = "MEMVAL-" + secrets.token_hex(24) + "x" * PAD
    payload = "OBSPAY-" + secrets.token_hex(24)
    slug = "mem/secret-" + secrets.token_hex(8)
    needles = {"value": value[:55].encode(), "payload": payload.encode(),
               "slug": slug.encode(), "credential": agent.credential.encode()}

    with ExitStack() as stack:
        sections: dict[str, dict[str, object]] = {"limits": {"enabled": False}}
        pids = {}
        if through_custodian:
            socket = tmp_path / "custodian.sock"
            process = CustodianProcess(
                write_custodian_config(tmp_path / "custodian.toml", token=token,
                                       state_dir=state, socket=socket, relay_url=local_relay),
                socket, unit_environment(CUSTODIAN_UNIT))
            process.start()
            stack.callback(process.stop)
            assert process.proc is not None
            pids["custodian"] = process.proc.pid
            sections["custody"] = {"custodian_socket": str(socket)}
        config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                              socket=tmp_path / "broker.sock", relay_url=local_relay,
                              sections=sections)
        daemon = stack.enter_context(_daemon(config, tmp_path / "daemon.log"))
        pids["daemon"] = daemon.pid
        for pid in pids.values():
            reason = readable_reason(pid)
            if reason is not None:
                pytest.skip(reason)

        async def drive() -> None:
            sock, credential = tmp_path / "broker.sock", agent.credential
            put = envelope(await post(sock, request_body(
                "storage.put", {"slug": slug, "value": value}), credential))
            assert put["status"] == "succeeded", put
            got = envelope(await post(sock, request_body("storage.get", {"slug": slug}),
                                      credential))
            assert got["status"] == "succeeded" and got["outcome"]["value"] == value, got
            emitted = envelope(await post(sock, request_body(
                "observer.emit", {"frames": [{"kind": "k", "payload": payload}]}), credential))
            assert emitted["status"] == "succeeded", emitted
            for _ in range(CHURN):
                churn = envelope(await post(sock, request_body(
                    "storage.address", {"slug": "core"}), churn_credential))
                assert churn["status"] == "succeeded", churn

        trio.run(drive)
        names = list(needles)
        # "daemon: value in rw-p [heap]" -> copies: where each copy lives, counted.
        found = Counter(f"{where}: {names[hit.needle]} in {hit.mapping.partition(' ')[2]}"
                        for where, pid in pids.items()
                        for hit in memory_hits(pid, tuple(needles.values())))
    assert not found, sorted(found.items())
