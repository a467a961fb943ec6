"""`make run`: the broker doing its real job on this machine, in one command. Development only.

    python -m tests.demo [--run-dir run] [--no-wait]
    python -m tests.demo --stop [--run-dir run]        (`make stop`)

Under ./run/ (kept between runs, so a second `make run` reuses the token, the agent and
its credential):
  softhsm/        a SoftHSM2 token made by softhsm/make-token (PINs in 0600 files, never shown)
  broker.toml     the daemon's configuration, pointing at the custodian and the relay below
  custodian.toml  the custodian's configuration (the token; its socket custodian.sock)
  state/          keystore, credentials, ledger (0700)
  agent.pub       the demo agent's public key
  credential      the demo agent's bearer credential (0600), reused while it is active
  credential.id   its id (not a secret: what `credential list` and `revoke` name)
  auth-header     `Authorization: Bearer …` for curl's `-H @file` (0600): the credential
                  never goes on a command line, where other users could read it
  channel         the demo channel id
  env             exports for the CLI, the agent client and the token (0600): paths only,
                  never the credential or the PIN; `source run/env`
  demo.lock, demo.pid   held by the running demo: a second one refuses, `--stop` ends it
  demo.children   the relay's, custodian's and daemon's pids while the demo runs: `--stop`
                  ends any a demo that did not end cleanly left behind, and a new demo
                  refuses to start beside them
  broker.log      the daemon's log, one JSON line per event
  custodian.log   the custodian's stderr

The keys are the custodian's (docs/custodian.md): a process of its own that alone logs in
to the token and signs; the daemon asks it over custodian.sock. Both run under the user's
own uid, without root, so NOTHING IS SEPARATED here but the process boundary: the daemon
could read the PIN file and the token itself. The demo says so when it starts; the two-uid
layout is docs/install.md step 6b.

It starts nostr-sdk's LocalRelay (the DEVELOPMENT relay, NIP-42 AUTH required, loopback
only), the custodian (`buzz-broker custodian run/custodian.toml`) and `buzz-broker serve`
in the foreground, prints a `curl --unix-socket` command that
posts a message, runs it, shows the answer, and then watches both until Ctrl-C, `make
stop`, or one of them dies (which it says, stopping the other). The three are SIGTERMed by
the kernel when the demo itself dies, however it dies (PR_SET_PDEATHSIG).

The demo owner is a random public key whose secret is thrown away at once: in production
an agent's owner is a human whose key this host never holds.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import io
import json
import os
import pwd
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import coincurve

from tests.fixtures.stop import terminate_then_kill
from tests.fixtures.units import BROKER_UNIT, CUSTODIAN_UNIT, unit_environment

REPO = Path(__file__).resolve().parent.parent
#: How long the relay and the daemon get to come up before the demo gives up.
STARTUP_SECONDS = 30.0
TOKEN_LABEL = "buzz-broker-demo"
#: A credential with less left than this is replaced rather than handed out again.
CREDENTIAL_MARGIN_SECONDS = 3600
LOCK_FILE, PID_FILE, CHILDREN_FILE = "demo.lock", "demo.pid", "demo.children"
#: What to do when run/ is in a state the demo cannot use or mend.
START_CLEAN = "remove {} and run `make run` again"
#: How often the running demo checks that its relay and daemon are still alive.
WATCH_SECONDS = 0.5


class DemoError(Exception):
    """One line for the user; the demo exits 1."""


def _bin(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def _run_both(argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # One line: the command's name and its own last word on why (never its arguments).
        words = argv[1:] if argv[0] == sys.executable else argv
        name = " ".join([Path(words[0]).name]
                        + [w for w in words[1:] if w.isalpha() and w.islower()][:2])
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        program = Path(words[0]).name
        last = last.removeprefix(f"{program}: ")
        raise DemoError(f"{name} failed: {last}")
    return done.stdout.strip(), done.stderr.strip()


def _run(argv: list[str], env: dict[str, str]) -> str:
    return _run_both(argv, env)[0]


def _private_file(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _hold_the_demo(run_dir: Path) -> int:
    """Take the run directory for this demo, or say which demo already has it.

    An flock, not a pid file alone: the kernel lets it go when the holder dies however it
    died, so a stale pid file never blocks a new demo.
    """
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = _demo_pid(run_dir)
        raise DemoError(
            f"a demo already runs in {run_dir}" + (f" (pid {pid})" if pid else "")
            + f": `source {run_dir / 'env'}` to use it, `make stop` to end it") from None
    _private_file(run_dir / PID_FILE, f"{os.getpid()}\n")
    return fd


def _demo_pid(run_dir: Path) -> int | None:
    try:
        text = (run_dir / PID_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _demo_running(run_dir: Path) -> bool:
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe itself took
    return False


def _start_time(pid: int) -> str | None:
    """The kernel's start time of live process `pid` (it tells a reused pid apart), or None
    if there is no such process or it is a zombie (dead, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


Children = dict[str, "subprocess.Popen[bytes] | subprocess.Popen[str]"]


def _record_children(run_dir: Path, children: Children) -> None:
    """`run/demo.children`: what `make stop` ends if this demo dies without ending them."""
    lines = [f"{name} {p.pid} {_start_time(p.pid)}\n" for name, p in children.items()]
    _private_file(run_dir / CHILDREN_FILE, "".join(lines))


def _listener_pid(path: Path) -> int | None:
    """The pid of the process listening on Unix socket `path` (SO_PEERCRED), or None if
    nothing answers there (no file, or a stale one)."""
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(path))
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid = struct.unpack("3i", creds)[0]
    return pid or None


def _left_behind(run_dir: Path) -> dict[int, str]:
    """What a demo that did not end cleanly left running here, pid -> what it is: the
    children it recorded that still run (the same processes: same start time), and whatever
    answers on the run directory's two sockets."""
    left: dict[int, str] = {}
    try:
        recorded = (run_dir / CHILDREN_FILE).read_text().splitlines()
    except OSError:
        recorded = []
    for line in recorded:
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit() and _start_time(int(parts[1])) == parts[2]:
            left[int(parts[1])] = parts[0]
    for name, sock in (("daemon", "broker.sock"), ("custodian", "custodian.sock")):
        pid = _listener_pid(run_dir / sock)
        if pid is not None and pid != os.getpid():
            left.setdefault(pid, name)
    return left


def _said(left: dict[int, str]) -> str:
    return ", ".join(f"{name} (pid {pid})" for pid, name in left.items())


def _end(pid: int, timeout: float) -> None:
    """SIGTERM `pid` (continued first, if stopped), then SIGKILL it after `timeout` s."""
    start = _start_time(pid)
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while start is not None and _start_time(pid) == start:
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.05)


def stop(run_dir: Path) -> int:
    """`make stop`: end the demo running in `run_dir` (its relay and daemon with it), or
    what a demo that did not end cleanly left running there."""
    pid = _demo_pid(run_dir)
    if not _demo_running(run_dir) or pid is None:
        left = _left_behind(run_dir)
        if not left:
            print(f"make stop: no demo runs in {run_dir}")
            return 0
        # The daemon first, as the demo itself would: it drains with the others still up.
        order = {"daemon": 0, "custodian": 1, "relay": 2}
        for child in sorted(left, key=lambda p: order.get(left[p], 3)):
            _end(child, 15)
        (run_dir / CHILDREN_FILE).unlink(missing_ok=True)
        print(f"make stop: no demo runs in {run_dir}; stopped what an earlier one left "
              f"running: {_said(left)}")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STARTUP_SECONDS
    while _demo_running(run_dir):
        if time.monotonic() > deadline:
            print(f"make stop: the demo (pid {pid}) did not stop within "
                  f"{STARTUP_SECONDS:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"make stop: stopped the demo (pid {pid}), its daemon, custodian and relay")
    return 0


#: prctl(2) option: the signal a child gets when its parent dies (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _dies_with(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when the demo (`parent`) dies, however it dies
    (kill -9 too), so no relay, custodian or daemon outlives it. Checked once more after the
    prctl: a demo that died before it was called already left the child to init."""
    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def _who() -> str:
    """This process's user as the demo names it: `name, uid N` (the number alone when the
    uid has no name)."""
    uid = os.getuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_token(run_dir: Path) -> dict[str, str]:
    tokens = run_dir / "softhsm" / "tokens"
    token_made = tokens.is_dir() and any(tokens.iterdir())
    if (run_dir / "state" / "keystore.db").exists() and not token_made:
        # make-token would make a new token, and `keys init` a new KEK beside a keystore
        # sealed under the old one: every request would then fail to unseal its agent's key.
        raise DemoError(f"{run_dir / 'state'} holds agent keys sealed under a token that is "
                        f"gone ({tokens} holds none), so they cannot be opened again: "
                        + START_CLEAN.format(run_dir))
    out = _run([sys.executable, str(REPO / "softhsm" / "make-token"), str(run_dir / "softhsm"),
                "--label", TOKEN_LABEL], dict(os.environ))
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key in ("SOFTHSM2_CONF", "module", "token_label", "pin_file"):
        if key not in facts:
            raise DemoError(f"softhsm/make-token did not report {key}")
    return facts


def _write_config(run_dir: Path, token: dict[str, str], relay_url: str) -> Path:
    config = run_dir / "broker.toml"
    config.write_text(
        "# Written by `make run` (tests/demo.py): a development daemon on this machine.\n"
        "[server]\n"
        f'socket = "{run_dir / "broker.sock"}"\n'
        "[state]\n"
        f'dir = "{run_dir / "state"}"\n'
        "[pkcs11]\n"
        f'module = "{token["module"]}"\n'
        f'token_label = "{token["token_label"]}"\n'
        f'pin_file = "{token["pin_file"]}"\n'
        "[relay]\n"
        f'url = "{relay_url}"\n'
        "[custody]\n"
        f'custodian_socket = "{run_dir / "custodian.sock"}"\n'
    )
    return config


def _write_custodian_config(run_dir: Path, token: dict[str, str], relay_url: str) -> Path:
    """The custodian's own file: same token, same state directory (one uid: the daemon's
    directory reads the keystore there); pipeline_uid defaults to this uid."""
    config = run_dir / "custodian.toml"
    _private_file(config, (
        "# Written by `make run` (tests/demo.py): the custodian, under your own uid.\n"
        "[custodian]\n"
        f'socket = "{run_dir / "custodian.sock"}"\n'
        f'state_dir = "{run_dir / "state"}"\n'
        f'relay_url = "{relay_url}"\n'
        "[pkcs11]\n"
        f'module = "{token["module"]}"\n'
        f'token_label = "{token["token_label"]}"\n'
        f'pin_file = "{token["pin_file"]}"\n'))
    return config


def _start_custodian(run_dir: Path, cli: list[str], env: dict[str, str]
                     ) -> subprocess.Popen[bytes]:
    log = run_dir / "custodian.log"
    config = run_dir / "custodian.toml"
    with log.open("ab") as err:
        custodian = subprocess.Popen([cli[0], "custodian", str(config)], env=env,
                                     stdout=subprocess.PIPE, stderr=err,
                                     preexec_fn=_dies_with(os.getpid()))
    assert custodian.stdout is not None
    if b"listening" not in custodian.stdout.readline():
        custodian.wait()
        raise DemoError(f"the custodian did not start (see {log})")
    return custodian


def _demo_agent(run_dir: Path, cli: list[str], env: dict[str, str]) -> str:
    pub_file = run_dir / "agent.pub"
    if pub_file.exists():
        pubkey = pub_file.read_text().strip()
        listed = [json.loads(line) for line in
                  _run([*cli, "agent", "list", "--json"], env).splitlines()]
        if any(a.get("pubkey") == pubkey for a in listed if a.get("deletedAt") is None):
            return pubkey
        # run/state was removed (or the agent with it): its agent file, credential and
        # header name what is no longer held here. A new agent, a new credential.
        print(f"{pub_file} names an agent {run_dir / 'state'} does not hold: "
              "making a new demo agent")
        for name in ("agent.pub", "credential", "credential.id", "auth-header"):
            (run_dir / name).unlink(missing_ok=True)
    owner = coincurve.PrivateKey(secrets.token_bytes(32)).public_key_xonly.format().hex()
    pubkey = _run([*cli, "agent", "create", "--owner", owner, "--name", "demo-agent"], env)
    pub_file.write_text(pubkey + "\n")
    return pubkey


def _demo_credential(run_dir: Path, cli: list[str], env: dict[str, str], agent: str,
                     channel: str) -> Path:
    """The demo agent's one credential: the one from the last run while it is active and
    not about to expire, else a new one (and the old one revoked). Returns the header file.
    """
    cred_file, id_file, header = (run_dir / "credential", run_dir / "credential.id",
                                  run_dir / "auth-header")
    old = id_file.read_text().strip() if id_file.exists() else None
    if old is not None and cred_file.exists():
        for line in _run([*cli, "credential", "list", "--json"], env).splitlines():
            info = json.loads(line)
            left = (info["expiresAt"] or float("inf")) - time.time()
            if info["id"] == old and info["state"] == "active" and left > CREDENTIAL_MARGIN_SECONDS:
                if not header.exists():
                    _private_file(header, f"Authorization: Bearer {cred_file.read_text().strip()}\n")
                return header
    credential, said = _run_both(
        [*cli, "credential", "issue", "--agent", agent, "--channel", channel, "--all-actions",
         "--ttl", "1d", "--uid", str(os.getuid()), "--label", "make run demo"], env)
    issued = said.split("issued ", 1)[1].split()[0] if "issued " in said else None
    if issued is None:
        raise DemoError("credential issue did not say the new credential's id")
    _private_file(cred_file, credential + "\n")
    _private_file(header, f"Authorization: Bearer {credential}\n")
    del credential
    id_file.write_text(issued + "\n")
    if old is not None:
        # The last run's credential, replaced: revoked, not left live beside the new one.
        subprocess.run([*cli, "credential", "revoke", old], env=env, capture_output=True)
    return header


def _write_env(run_dir: Path, token: dict[str, str], config: Path) -> Path:
    """`run/env`: what a fresh shell needs to reach the demo. Paths only, never a secret."""
    env_file = run_dir / "env"
    exports = {
        "BUZZ_BROKER_CONFIG": str(config),
        "SOFTHSM2_CONF": token["SOFTHSM2_CONF"],
        "BUZZ_BROKER_SOCKET": str(run_dir / "broker.sock"),
        "BUZZ_BROKER_CREDENTIAL_FILE": str(run_dir / "credential"),
    }
    lines = ["# The demo's environment, written by `make run`: source it in a shell.\n"]
    lines += [f"export {name}={shlex.quote(value)}\n" for name, value in exports.items()]
    lines.append(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"\n")
    _private_file(env_file, "".join(lines))
    return env_file


def _watch(relay: subprocess.Popen[str], daemon: subprocess.Popen[bytes], log: Path,
           custodian: subprocess.Popen[bytes]) -> NoReturn:
    """Return only by Ctrl-C or SIGTERM; a relay, custodian or daemon that dies is said."""
    while True:
        if (code := relay.poll()) is not None:
            raise DemoError(f"the development relay exited (status {code}); stopping the daemon")
        if (code := custodian.poll()) is not None:
            raise DemoError(f"the custodian exited (status {code}; see "
                            f"{log.with_name('custodian.log')}); stopping the daemon")
        if (code := daemon.poll()) is not None:
            raise DemoError(f"buzz-broker serve exited (status {code}; see {log}); "
                            "stopping the relay")
        time.sleep(WATCH_SECONDS)


def _wait_for_socket(path: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until `process` answers on `path`: a connect() that succeeds, not a file that exists
    (a demo killed outright leaves its socket file behind, answered by nobody)."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DemoError(f"buzz-broker serve exited during startup (see {log})")
        if _listener_pid(path) == process.pid:
            return
        time.sleep(0.1)
    raise DemoError(f"buzz-broker serve did not bind {path} within {STARTUP_SECONDS:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="run")
    parser.add_argument("--no-wait", action="store_true",
                        help="stop after the first request instead of waiting for Ctrl-C")
    parser.add_argument("--stop", action="store_true", help="end the demo running there")
    args = parser.parse_args()
    # Line by line even into a pipe: whoever watches the demo sees each step as it happens.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        print(f"make {'stop' if args.stop else 'run'}: {run_dir} is not a directory: "
              f"{START_CLEAN.format(run_dir)}", file=sys.stderr)
        return 1
    if args.stop:
        try:
            return stop(run_dir)
        except OSError as exc:
            print(f"make stop: {exc}", file=sys.stderr)
            return 1
    relay: subprocess.Popen[str] | None = None
    daemon: subprocess.Popen[bytes] | None = None
    custodian: subprocess.Popen[bytes] | None = None
    children: Children = {}
    try:
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _hold_the_demo(run_dir)  # held until this process exits
        if left := _left_behind(run_dir):
            raise DemoError(f"an earlier demo in {run_dir} did not end cleanly and left "
                            f"{_said(left)} running: `make stop` ends what it left")
        token = _make_token(run_dir)
        env = dict(os.environ, SOFTHSM2_CONF=token["SOFTHSM2_CONF"])
        env.pop("BUZZ_BROKER_CONFIG", None)

        relay = subprocess.Popen(
            [sys.executable, "-m", "tests.devrelay", "--host", "127.0.0.1",
             "--port", str(_free_port()), "--auth"],
            cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=_dies_with(os.getpid()),
        )
        children["relay"] = relay
        _record_children(run_dir, children)
        assert relay.stdout is not None
        relay_url = relay.stdout.readline().strip()
        if not relay_url.startswith("ws://"):
            raise DemoError("the development relay did not start")
        print(f"development relay (nostr-sdk LocalRelay, NIP-42 AUTH): {relay_url} "
              f"(pid {relay.pid})")

        config = _write_config(run_dir, token, relay_url)
        custodian_config = _write_custodian_config(run_dir, token, relay_url)
        cli = [_bin("buzz-broker"), "--config", str(config)]
        # The KEK is the custodian's: its own command makes it, before it serves (the
        # daemon's `keys init` refuses where a custodian holds the keys).
        _run([cli[0], "custodian", str(custodian_config), "keys", "init"], env)
        # Both run with their units' environment (the allocator settings that overwrite
        # every free: docs/custodian.md, "Plaintexts and credentials"), as installed.
        custodian = _start_custodian(run_dir, cli, env | unit_environment(CUSTODIAN_UNIT))
        children["custodian"] = custodian
        _record_children(run_dir, children)
        # Whoever runs it: `make run` as root is as common as without, and runs both as root.
        print(f"custodian (the keys, in their own process): {run_dir / 'custodian.sock'} "
              f"(pid {custodian.pid}). It and the daemon run under one uid, yours "
              f"({_who()}): NOTHING IS SEPARATED here but the process: the daemon could "
              "read the PIN file and the token itself. Two uids: docs/install.md step 6b.")
        agent = _demo_agent(run_dir, cli, env)
        channel_file = run_dir / "channel"
        if not channel_file.exists():
            channel_file.write_text(str(uuid.uuid4()) + "\n")
        channel = channel_file.read_text().strip()
        header = _demo_credential(run_dir, cli, env, agent, channel)
        env_file = _write_env(run_dir, token, config)
        print(f"demo agent {agent} in channel {channel}")

        socket_path = run_dir / "broker.sock"
        log_path = run_dir / "broker.log"
        with log_path.open("ab") as log:
            # The daemon's JSON log lines go to a file, so the terminal shows the request and
            # its answer; `tail -f run/broker.log` follows the daemon as journald would.
            daemon = subprocess.Popen([*cli, "serve"], env=env | unit_environment(BROKER_UNIT),
                                      stderr=log,
                                      preexec_fn=_dies_with(os.getpid()))
        children["daemon"] = daemon
        _record_children(run_dir, children)
        _wait_for_socket(socket_path, daemon, log_path)
        print(f"daemon log (one JSON line per event): {log_path}")

        body = ('{"type":"broker_request","protocolVersion":1,'
                f'"requestId":"demo-{uuid.uuid4()}","actionVersion":1,"action":"message.post",'
                f'"args":{{"channelId":"{channel}","content":"hello from a keyless agent"}}}}')
        command = (
            f"curl -sS --unix-socket {shlex.quote(str(socket_path))} "
            f"-H @{shlex.quote(str(header))} "
            "-H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} http://broker/v1/action"
        )
        print("\nA first request (paste it to try again; use a new requestId for a new message):")
        print(f"  {command}\n")
        answer = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        print(f"answer: {answer.stdout.strip() or answer.stderr.strip()}")
        if '"status":"succeeded"' not in answer.stdout:
            raise DemoError("the first request did not succeed")
        print(f"\nTo use the demo from another shell (the CLI, the agent client, the token):\n"
              f"  source {shlex.quote(str(env_file))}\n"
              f"  buzz-broker status")
        if args.no_wait:
            return 0
        print("\nThe broker, its custodian and the development relay are running. "
              "Ctrl-C or `make stop` stops all three.", flush=True)
        _watch(relay, daemon, log_path, custodian)
    except DemoError as exc:
        print(f"make run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except OSError as exc:  # run/ half made or not ours: one line, never a traceback
        print(f"make run: {exc}: if {run_dir} is half made, {START_CLEAN.format(run_dir)}",
              file=sys.stderr)
        return 1
    finally:
        # One at a time: the daemon drains with its custodian and relay still up.
        for process in (daemon, custodian, relay):
            if process is not None:
                terminate_then_kill(process, 15)
        if children:
            (run_dir / CHILDREN_FILE).unlink(missing_ok=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
