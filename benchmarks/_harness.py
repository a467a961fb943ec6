"""Shared setup for the daemon benchmarks: a real token, a real daemon process, a real relay.

Everything lives in one temporary directory that is removed afterwards:
  token/        a SoftHSM2 token made by softhsm/make-token (PINs in 0600 files, never shown)
  state/        keystore, credentials, ledger of the daemon under test
  broker.toml   its configuration; broker.sock its socket; daemon.log its stderr
  agents.json   the benchmark agents: pubkey, channel and bearer credential (0600; it is
                how the load-generator processes get their credentials - never printed)

Rules:
- The daemon is the real one, `buzz-broker serve`, in its own process; readiness is its
  ``READY=1`` datagram on a ``NOTIFY_SOCKET`` we bind (what systemd would see), and the
  time to it is measured from just before the process is spawned.
- Relays are processes too: the null relay (benchmarks/null_relay.py) or nostr-sdk's
  LocalRelay (``python -m tests.devrelay --auth``), loopback only.
- Agents are imported through `Custody.import_agent` (the path `agent import` takes) when
  there are few. For thousands (the startup benchmark) `bulk_agents` seals each key with
  the token exactly as custody does but writes all rows in one keystore transaction:
  thousands of one-row fsynced transactions would only measure this disk. Credentials go
  through `SessionStore.issue`, the path `credential issue` takes.
- Secrets: agent secret keys are random, passed to custody as zeroable bytearrays and
  dropped; credentials are written only to the 0600 agents.json.
"""

from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import coincurve
import trio

REPO = Path(__file__).resolve().parents[1]
# First, always: a script's own folder leads sys.path, and there `custody` is
# benchmarks/custody.py, not the package (with the repository on PYTHONPATH too, as a
# clone's tests run, a check for it already there left the folder first).
sys.path.insert(0, str(REPO))

from custody import Custody, TokenConfig, init_kek  # noqa: E402
from daemon.state.sessions import SessionStore  # noqa: E402
from tests.fixtures.broker import write_config as broker_config  # noqa: E402

TOKEN_LABEL = "buzz-bench"
KEK_LABEL = "buzz-bench-kek"
#: How long a relay or the daemon gets to come up before the benchmark gives up.
STARTUP_SECONDS = 60.0
#: Every action, so one credential can run any mix.
ALL_ACTIONS = frozenset({
    "channel.read", "message.post", "message.reply", "reaction.add", "profile.set",
    "storage.address", "agents.create", "agents.update", "agents.delete",
})


@dataclass(frozen=True)
class Agent:
    pubkey: str
    channel: str
    credential: str

    def to_json_obj(self) -> dict[str, str]:
        return {"pubkey": self.pubkey, "channel": self.channel, "credential": self.credential}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def buzz_broker_bin() -> str:
    candidate = Path(sys.executable).with_name("buzz-broker")
    return str(candidate) if candidate.exists() else "buzz-broker"


def make_token(directory: Path) -> TokenConfig:
    """A fresh SoftHSM2 token; sets SOFTHSM2_CONF in os.environ for this process and children."""
    done = subprocess.run(
        [sys.executable, str(REPO / "softhsm" / "make-token"), str(directory), "--label", TOKEN_LABEL],
        capture_output=True, text=True, check=False, timeout=120,
    )
    if done.returncode != 0:
        raise SystemExit(f"softhsm/make-token failed: {done.stderr.strip()}")
    facts = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    os.environ["SOFTHSM2_CONF"] = facts["SOFTHSM2_CONF"]
    token = TokenConfig(module=facts["module"], token_label=facts["token_label"],
                        pin_file=facts["pin_file"], kek_label=KEK_LABEL)
    trio.run(init_kek, token)
    return token


def write_config(path: Path, token: TokenConfig, state_dir: Path, sock: Path, relay_url: str,
                 *, log_level: str = "info", relay: dict[str, object] | None = None,
                 custody: dict[str, object] | None = None) -> Path:
    # Rate limits off: the benchmark measures capacity, and one agent posting hundreds per
    # second would be refused by the default 60/min (docs/configuration.md). Relay timeouts
    # stay at the daemon's defaults. `relay`, `custody`: more keys of those sections (a
    # read window off, a custodian's socket).
    sections: dict[str, dict[str, object]] = {"server": {"max_connections": 4096},
                                              "log": {"level": log_level},
                                              "limits": {"enabled": False}}
    if relay:
        sections["relay"] = dict(relay)
    if custody:
        sections["custody"] = dict(custody)
    return broker_config(path, token=token, state_dir=state_dir, socket=sock,
                         relay_url=relay_url, relay_timeout=10.0, sections=sections)


def _owner() -> str:
    return coincurve.PrivateKey().public_key_xonly.format().hex()


async def import_agents(token: TokenConfig, state_dir: Path, n: int) -> list[str]:
    """n human-owned agents imported through custody (one token hop and commit each)."""
    custody = await Custody.open(token, state_dir)
    try:
        out = []
        for i in range(n):
            secret = bytearray(coincurve.PrivateKey().secret.hex().encode("ascii"))
            record = await custody.import_agent(secret, owner=_owner())
            out.append(record.pubkey)
        return out
    finally:
        await custody.aclose()


def bulk_agents(token: TokenConfig, state_dir: Path, n: int) -> list[str]:
    """n agents sealed under the token exactly as custody seals them, written in one
    transaction (see the module docstring: the startup benchmark needs 10,000)."""
    from custody._keystore import KeyRecord, Keystore
    from custody._sealed import seal
    from custody._secret import random_secret
    from custody._secp256k1 import xonly_pubkey
    from custody._token import Token
    from custody._worker import run_locked

    return run_locked(lambda: _bulk_agents_locked(token, state_dir, n, KeyRecord, Keystore, seal,
                                                  random_secret, xonly_pubkey, Token))


def _bulk_agents_locked(token: TokenConfig, state_dir: Path, n: int, KeyRecord: Any, Keystore: Any,
                        seal: Any, random_secret: Any, xonly_pubkey: Any, Token: Any) -> list[str]:
    opened = Token.open(token)
    keystore = Keystore.open(state_dir)
    now = int(time.time())
    rows = []
    try:
        for i in range(n):
            with random_secret() as secret:
                pubkey = xonly_pubkey(secret).hex()
                rows.append((pubkey, _owner(), now, now, seal(opened, secret, pubkey)))
        with keystore.transaction() as db:
            db.executemany(
                "INSERT INTO keys (pubkey, owner, auth_tag, mint_ref, created_at, updated_at,"
                " deleted_at, sealed) VALUES (?, ?, NULL, NULL, ?, ?, NULL, ?)",
                rows,
            )
    finally:
        keystore.close()
        opened.close()
    # Prove the bulk rows are what custody reads: the first one is a live agent record.
    check = Keystore.open(state_dir)
    try:
        record = check.get(rows[0][0]) if rows else None
        assert record is None or isinstance(record, KeyRecord) and record.live
    finally:
        check.close()
    return [row[0] for row in rows]


def issue_credentials(state_dir: Path, pubkeys: Sequence[str], channels: Sequence[str]) -> list[Agent]:
    """One credential per agent for its channel (agents share channels round robin)."""
    store = SessionStore.open(state_dir)
    try:
        out = []
        for i, pubkey in enumerate(pubkeys):
            channel = channels[i % len(channels)]
            _, token = store.issue(agent=pubkey, channels=frozenset({channel}), actions=ALL_ACTIONS,
                                   ttl_seconds=None, uid=None, now=int(time.time()))
            out.append(Agent(pubkey, channel, token))
        return out
    finally:
        store.close()


def write_agents(path: Path, agents: Sequence[Agent]) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump([a.to_json_obj() for a in agents], fh)
    return path


def read_agents(path: str | Path) -> list[Agent]:
    with open(path, encoding="utf-8") as fh:
        return [Agent(**obj) for obj in json.load(fh)]


def new_channel() -> str:
    return str(uuid.uuid4())


@contextmanager
def relay_process(kind: str, *, events_file: Path | None = None) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """("null" | "local") relay on a free loopback port; yields (url, process)."""
    port = free_port()
    if kind == "null":
        argv = [sys.executable, str(REPO / "benchmarks" / "null_relay.py"), "--port", str(port)]
        if events_file is not None:
            argv += ["--events", str(events_file)]
    elif kind == "local":
        argv = [sys.executable, "-m", "tests.devrelay", "--host", "127.0.0.1", "--port", str(port), "--auth"]
    else:
        raise ValueError(f"unknown relay kind {kind!r}")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("ws://"):
            raise SystemExit(f"the {kind} relay did not start")
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Daemon:
    proc: subprocess.Popen[bytes]
    socket: Path
    ready_seconds: float
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextmanager
def daemon_process(config: Path, workdir: Path, *, environ: dict[str, str] | None = None,
                   command: Sequence[str] | None = None) -> Iterator[Daemon]:
    """`buzz-broker serve` with a NOTIFY_SOCKET of ours; yields once READY=1 arrived.

    `command`: how to start another build of the daemon (a pinned commit's, for
    benchmarks/fleet.py and benchmarks/read_disk.py); such a build also needs its own
    `environ`, `pinned_environ()`, or the caller's PYTHONPATH picks its code."""
    notify_path = workdir / f"notify-{uuid.uuid4().hex[:8]}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    env = dict(os.environ if environ is None else environ, NOTIFY_SOCKET=str(notify_path))
    env.pop("BUZZ_BROKER_CONFIG", None)
    log_path = workdir / "daemon.log"
    sock = _socket_of(config)
    with open(log_path, "ab") as log:
        started = time.perf_counter()
        proc = subprocess.Popen([*(command or [buzz_broker_bin()]), "--config", str(config),
                                 "serve"], env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        listener.settimeout(0.25)
        deadline = time.monotonic() + STARTUP_SECONDS
        ready = None
        while ready is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").splitlines()[-3:]
                raise SystemExit(f"buzz-broker serve did not become ready: {tail}")
            try:
                datagram = listener.recv(4096)
            except socket.timeout:
                continue
            if b"READY=1" in datagram.split(b"\n"):
                ready = time.perf_counter() - started
        yield Daemon(proc, sock, ready, log_path)
    finally:
        listener.close()
        stop(proc)


def _socket_of(config: Path) -> Path:
    for line in config.read_text().splitlines():
        if line.startswith("socket = "):
            return Path(line.split('"')[1])
    raise ValueError("config has no [server] socket")


@contextmanager
def custodian_process(token: TokenConfig, state_dir: Path, relay_url: str,
                      workdir: Path, *, environ: dict[str, str] | None = None
                      ) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """The custodian (`python -m custody.custodian`), the process an installed daemon signs
    through (docs/install.md), over the same token and state; yields (its socket, process).
    A daemon uses it with write_config(..., custody={"custodian_socket": str(socket)}).
    `environ`: its environment (default this process's)."""
    sock = workdir / "custodian.sock"
    config = workdir / "custodian.toml"
    config.write_text(
        f'[custodian]\nsocket = "{sock}"\nstate_dir = "{state_dir}"\n'
        f'relay_url = "{relay_url}"\nsignatures_per_minute = 1000000\n'
        f'[pkcs11]\nmodule = "{token.module}"\ntoken_label = "{token.token_label}"\n'
        f'pin_file = "{token.pin_file}"\nkek_label = "{token.kek_label}"\n')
    err_path = workdir / "custodian.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "custody.custodian", str(config)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=environ)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening" not in line:
            raise SystemExit(f"the custodian did not start: {err_path.read_text()[-500:]}")
        yield sock, proc
    finally:
        stop(proc)


@dataclass(frozen=True)
class ProcStat:
    rss_bytes: int
    cpu_seconds: float  # user + system so far


def proc_stat(pid: int) -> ProcStat:
    """RSS and CPU time of a process from /proc (Linux)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
    rss = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return ProcStat(rss, cpu)


def machine() -> dict[str, Any]:
    """nproc, CPU model and memory, for every figure printed."""
    model = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return {"nproc": os.cpu_count(), "cpu": model, "mem_gib": round(mem_kb / 2**20, 1),
            "loadavg": open("/proc/loadavg").read().split()[:3]}


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="buzz-bench-") as tmp:
        yield Path(tmp)


# ------------------------------------------------------------------ a pinned build


def cache_dir() -> Path:
    explicit = os.environ.get("BUZZ_BROKER_BENCH_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "buzz-broker-bench"


def pinned_build(commit: str) -> tuple[Path, str]:
    """A pinned commit, unpacked and installed into its own venv once, then reused: its home
    (`src/`, `venv/`) in the cache and its full id. For the benchmarks that compare against
    code from before a change (fleet.py, read_disk.py).

    `git archive` rather than `git worktree add`: it leaves no entry in the repository's
    worktree list, and the cached tree never changes under a checkout.
    """
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                         capture_output=True, text=True, check=False)
    if sha.returncode != 0:
        raise SystemExit(f"the baseline commit {commit} is not in this repository's history")
    full = sha.stdout.strip()
    home = cache_dir() / full
    if not (home / "built").exists():
        # Built in place (a venv's scripts name its own path), marked built last: a build
        # cut short is found unmarked and redone.
        print(json.dumps({"building_baseline": full[:12], "into": "the benchmark cache"}), flush=True)
        shutil.rmtree(home, ignore_errors=True)
        (home / "src").mkdir(parents=True)
        archive = subprocess.Popen(["git", "-C", str(REPO), "archive", "--format=tar", full],
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(home / "src")], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit("git archive of the baseline failed")
        subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(home / "venv")],
                       check=True)
        subprocess.run([str(home / "venv" / "bin" / "python"), "-m", "pip", "install", "-q",
                        str(home / "src")], check=True)
        (home / "built").write_text(full + "\n")
    return home, full


#: Environment variables that can change which code a Python process imports (or where it
#: looks first): a pinned build run with the caller's PYTHONPATH naming this checkout
#: imports the checkout's `daemon`, and a "ratio to baseline" is then the code against itself.
IMPORT_REDIRECTS = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP",
                    "PYTHONPLATLIBDIR", "PYTHONEXECUTABLE", "VIRTUAL_ENV")


def pinned_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a pinned build (its setup and its daemon) runs in: the caller's
    (default os.environ, so the token's SOFTHSM2_CONF stays) without anything that could
    redirect its imports, and without the user's site-packages."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()
           if k not in IMPORT_REDIRECTS}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def check_pinned_imports(python: str | Path, home: Path, environ: dict[str, str]) -> Path:
    """Where the pinned build's `python` imports `daemon` from, run as its daemon is (that
    environment, a working directory holding no package); SystemExit unless it lies under
    the build's own `home`. Called before anything is measured."""
    done = subprocess.run([str(python), "-c", "import daemon; print(daemon.__file__)"],
                          cwd=home, env=environ, capture_output=True, text=True, check=False,
                          timeout=60)
    where = Path(done.stdout.strip()).resolve() if done.returncode == 0 else None
    if where is None or not where.is_relative_to(Path(home).resolve()):
        raise SystemExit(f"the pinned build at {home} imports daemon from "
                         f"{where or done.stderr.strip().splitlines()[-1:]}, not its own tree: "
                         "its figures would not be the baseline's")
    return where
