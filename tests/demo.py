"""`make run`: the broker doing its real job on this machine, in one command. Development only.

    python -m tests.demo [--run-dir run] [--no-wait]

Under ./run/ (kept between runs, so a second `make run` reuses the token and the agent):
  softhsm/        a SoftHSM2 token made by softhsm/make-token (PINs in 0600 files, never shown)
  broker.toml     the daemon's configuration, pointing at the token and the relay below
  state/          keystore, credentials, ledger (0700)
  agent.pub       the demo agent's public key
  credential      the demo agent's bearer credential (0600; the printed command reads it)
  channel         the demo channel id
  broker.log      the daemon's log, one JSON line per event

It starts nostr-sdk's LocalRelay (the DEVELOPMENT relay, NIP-42 AUTH required, loopback
only) and `buzz-broker serve` in the foreground, prints a `curl --unix-socket` command that
posts a message, runs it, shows the answer, and then waits until Ctrl-C stops both.

The demo owner is a random public key whose secret is thrown away at once: in production
an agent's owner is a human whose key this host never holds.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import coincurve

REPO = Path(__file__).resolve().parent.parent
#: How long the relay and the daemon get to come up before the demo gives up.
STARTUP_SECONDS = 30.0
TOKEN_LABEL = "buzz-broker-demo"


class DemoError(Exception):
    """One line for the user; the demo exits 1."""


def _bin(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def _run(argv: list[str], env: dict[str, str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, env=env, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise DemoError(f"{' '.join(argv[:4])} ...: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_token(run_dir: Path) -> dict[str, str]:
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
    )
    return config


def _demo_agent(run_dir: Path, cli: list[str], env: dict[str, str]) -> str:
    pub_file = run_dir / "agent.pub"
    if pub_file.exists():
        return pub_file.read_text().strip()
    owner = coincurve.PrivateKey(secrets.token_bytes(32)).public_key_xonly.format().hex()
    pubkey = _run([*cli, "agent", "create", "--owner", owner, "--name", "demo-agent"], env)
    pub_file.write_text(pubkey + "\n")
    return pubkey


def _wait_for_socket(path: Path, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DemoError(f"buzz-broker serve exited during startup (see {log})")
        if path.is_socket():
            return
        time.sleep(0.1)
    raise DemoError(f"buzz-broker serve did not bind {path} within {STARTUP_SECONDS:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="run")
    parser.add_argument("--no-wait", action="store_true",
                        help="stop after the first request instead of waiting for Ctrl-C")
    args = parser.parse_args()
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(mode=0o700, exist_ok=True)

    token = _make_token(run_dir)
    env = dict(os.environ, SOFTHSM2_CONF=token["SOFTHSM2_CONF"])
    env.pop("BUZZ_BROKER_CONFIG", None)

    relay = subprocess.Popen(
        [sys.executable, "-m", "tests.devrelay", "--host", "127.0.0.1",
         "--port", str(_free_port()), "--auth"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    daemon: subprocess.Popen[bytes] | None = None
    try:
        assert relay.stdout is not None
        relay_url = relay.stdout.readline().strip()
        if not relay_url.startswith("ws://"):
            raise DemoError("the development relay did not start")
        print(f"development relay (nostr-sdk LocalRelay, NIP-42 AUTH): {relay_url}")

        config = _write_config(run_dir, token, relay_url)
        cli = [_bin("buzz-broker"), "--config", str(config)]
        _run([*cli, "keys", "init"], env)
        agent = _demo_agent(run_dir, cli, env)
        channel_file = run_dir / "channel"
        if not channel_file.exists():
            channel_file.write_text(str(uuid.uuid4()) + "\n")
        channel = channel_file.read_text().strip()
        credential = _run([*cli, "credential", "issue", "--agent", agent, "--channel", channel,
                           "--all-actions", "--ttl", "1d", "--uid", str(os.getuid())], env)
        cred_file = run_dir / "credential"
        cred_file.touch(mode=0o600)
        os.chmod(cred_file, 0o600)
        cred_file.write_text(credential + "\n")
        del credential
        print(f"demo agent {agent} in channel {channel}")

        socket_path = run_dir / "broker.sock"
        log_path = run_dir / "broker.log"
        with log_path.open("ab") as log:
            # The daemon's JSON log lines go to a file, so the terminal shows the request and
            # its answer; `tail -f run/broker.log` follows the daemon as journald would.
            daemon = subprocess.Popen([*cli, "serve"], env=env, stderr=log)
        _wait_for_socket(socket_path, daemon, log_path)
        print(f"daemon log (one JSON line per event): {log_path}")

        body = ('{"type":"broker_request","protocolVersion":1,'
                f'"requestId":"demo-{uuid.uuid4()}","actionVersion":1,"action":"message.post",'
                f'"args":{{"channelId":"{channel}","content":"hello from a keyless agent"}}}}')
        command = (
            f"curl -sS --unix-socket {shlex.quote(str(socket_path))} "
            "-H \"Authorization: Bearer $(cat " + shlex.quote(str(cred_file)) + ")\" "
            "-H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} http://broker/v1/action"
        )
        print("\nA first request (paste it to try again; use a new requestId for a new message):")
        print(f"  {command}\n")
        answer = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        print(f"answer: {answer.stdout.strip() or answer.stderr.strip()}")
        if '"status":"succeeded"' not in answer.stdout:
            raise DemoError("the first request did not succeed")
        if args.no_wait:
            return 0
        print("\nThe broker and the development relay are running. Ctrl-C stops both.")
        while True:
            time.sleep(3600)
    except DemoError as exc:
        print(f"make run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for process in (daemon, relay):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (daemon, relay):
            if process is not None:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
