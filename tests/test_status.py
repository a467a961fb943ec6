"""`buzz-broker status` on a running and then a stopped daemon (a real `serve` subprocess,
SoftHSM token, LocalRelay), and the root guard on the daemon's state directory."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from custody import TokenConfig
from daemon.cli import main
from tests.fixtures.broker import write_config
from tests.fixtures.relay import TestKey
from tests.fixtures.token import SoftHsmToken

REPO = Path(__file__).resolve().parent.parent


def _cli(config: Path, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config), *argv],
                          cwd=REPO, env=env, input=stdin, capture_output=True, text=True,
                          timeout=60)


@contextlib.contextmanager
def _serving(config: Path, socket_path: Path) -> Iterator[subprocess.Popen[str]]:
    """`buzz-broker serve` on `config`, once its socket is there; SIGTERM at the end."""
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "--config", str(config),
                               "serve"], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr and daemon.stderr.read()
            time.sleep(0.05)
        yield daemon
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)


def test_status_running_then_stopped(custody_state: tuple[TokenConfig, Path], local_relay: str,
                                     tmp_path: Path) -> None:
    from tests.fixtures.relay import free_port

    token, state = custody_state
    socket_path = tmp_path / "b.sock"
    metrics = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=socket_path, relay_url=local_relay,
                          sections={"metrics": {"listen": metrics,
                                                "listen_accept_squatting_risk": True,
                                                "socket": str(tmp_path / "admin.sock")}})
    admin = tmp_path / "admin.sock"
    channel = str(uuid.uuid4())
    agent = _cli(config, "agent", "create", "--owner", TestKey().pubkey, "--name", "s")
    assert agent.returncode == 0, agent.stderr
    credential = _cli(config, "credential", "issue", "--agent", agent.stdout.strip(),
                      "--channel", channel, "--action", "message.post", "--ttl", "1h",
                      "--uid", str(os.getuid()))
    assert credential.returncode == 0, credential.stderr
    cred_file = tmp_path / "credential"
    cred_file.write_text(credential.stdout)
    cred_file.chmod(0o400)

    before = _cli(config, "status")
    assert before.returncode == 3, before.stdout + before.stderr
    assert re.search(r"^daemon: +stopped$", before.stdout, re.M)

    with _serving(config, socket_path) as daemon:
        post = _cli(config, "call", "message.post", "--args",
                    json.dumps({"channelId": channel, "content": "status"}),
                    "--credential-file", str(cred_file), "--socket", str(socket_path))
        assert post.returncode == 0, post.stdout + post.stderr

        running = _cli(config, "status", "--json")
        assert running.returncode == 0, running.stdout + running.stderr
        facts = json.loads(running.stdout)
        # Typed members, not display strings; `detail` keeps the line's text.
        assert facts["daemon"] == {"ok": True, "detail": f"running (pid {daemon.pid})",
                                   "running": True, "pid": daemon.pid}
        assert facts["config"] == {"ok": True, "detail": f"{config} (--config)",
                                   "origin": "--config", "path": str(config)}
        assert (facts["socket"]["mode"], facts["socket"]["path"]) == ("0660", str(socket_path))
        assert facts["token"]["ok"] is True
        assert facts["token"]["detail"].startswith(f"logged in to {token.token_label!r}")
        assert facts["relay"]["detail"].startswith(f"{local_relay}: WebSocket opened")
        assert (facts["agents"]["live"], facts["agents"]["deleted"]) == (1, 0)
        assert (facts["credentials"]["active"], facts["credentials"]["inactive"]) == (1, 0)
        audit = facts["audit"]
        assert type(audit["records"]) is int and audit["records"] >= 1 and audit["ok"] is True
        assert audit["seq"] == audit["records"] and re.fullmatch(r"[0-9a-f]{64}", audit["head"])
        assert "null" not in running.stdout
        assert (facts["running"], facts["ok"], facts["exit"]) == (True, True, 0)
        assert credential.stdout.strip() not in running.stdout
        # What the running daemon serves [metrics] listen under (its note, as for tcp).
        unheld = "unheld: the operator accepted the squatting risk (listen_accept_squatting_risk)"
        assert facts["metrics"] == {"ok": True, "socket": str(admin), "listen": metrics,
                                    "serving": f"{metrics} ({unheld})",
                                    "detail": f"socket {admin}; serving {metrics} ({unheld})"}
        text = _cli(config, "status")
        assert re.search(rf"^daemon: +running \(pid {daemon.pid}\)$", text.stdout, re.M)
    assert daemon.returncode == 0

    stopped = _cli(config, "status", "--json")
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    facts = json.loads(stopped.stdout)
    assert facts["daemon"] == {"ok": True, "detail": "stopped", "running": False}
    assert facts["running"] is False
    assert facts["socket"] == {"ok": False, "detail": f"{socket_path}: absent",
                               "path": str(socket_path), "exists": False}
    assert facts["agents"]["live"] == 1  # the stores are read without the daemon
    assert facts["token"]["detail"].startswith("logged in")
    # Stopped: which squatting rule [metrics] listen will be under, as for listen_tcp.
    assert facts["metrics"] == {"ok": True, "socket": str(admin), "listen": metrics, "detail": (
        f"socket {admin}; {metrics}: held by systemd (socket activation) if passed, else {unheld}")}


def test_status_names_the_metrics_socket(custody_state: tuple[TokenConfig, Path],
                                         tmp_path: Path) -> None:
    """Metrics served on [metrics] socket alone are not "off": status used to say
    `metrics: off ([metrics] listen is empty)`, and --json the same, for a daemon serving
    them on its admin socket."""
    from tests.fixtures.relay import free_port

    token, state = custody_state
    admin = tmp_path / "admin.sock"
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url=f"ws://127.0.0.1:{free_port()}",
                          relay_timeout=1.0, sections={"metrics": {"socket": str(admin)}})
    facts = json.loads(_cli(config, "status", "--json").stdout)
    assert facts["metrics"] == {"ok": True, "detail": f"socket {admin}", "socket": str(admin)}
    text = _cli(config, "status").stdout
    assert re.search(rf"^metrics: +socket {re.escape(str(admin))}$", text, re.M), text
    # Neither: off, and the line names both keys.
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url=f"ws://127.0.0.1:{free_port()}",
                          relay_timeout=1.0)
    facts = json.loads(_cli(config, "status", "--json").stdout)
    assert facts["metrics"] == {"ok": True,
                                "detail": "off ([metrics] socket and listen are empty)"}


def test_status_with_a_broken_relay_is_degraded_not_a_crash(
    custody_state: tuple[TokenConfig, Path], tmp_path: Path
) -> None:
    from tests.fixtures.relay import free_port

    token, state = custody_state
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=state,
                          socket=tmp_path / "b.sock", relay_url=f"ws://127.0.0.1:{free_port()}",
                          relay_timeout=1.0)
    done = _cli(config, "status")
    assert done.returncode == 3  # not running outranks the failed check
    assert re.search(r"^relay: +FAILED: ws://127\.0\.0\.1:[0-9]+: cannot connect", done.stdout,
                     re.M), done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the guard is about commands run as root")
def test_root_is_refused_on_a_state_directory_the_daemon_user_owns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)  # nobody: stands for the daemon's user
    config = tmp_path / "broker.toml"
    config.write_text(f'[state]\ndir = "{state}"\n[relay]\nurl = "ws://127.0.0.1:9"\n')
    for argv in (["credential", "list"], ["agent", "list"], ["status"], ["keys", "init"]):
        assert main(["--config", str(config), *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"buzz-broker: refusing to run as root on {state}: it belongs to ")
        assert "buzz-broker-admin" in err and err.count("\n") == 1
    assert list(state.iterdir()) == []  # nothing was created
    # check-config touches no state: it still runs.
    assert main(["--config", str(config), "check-config"]) == 0
    capsys.readouterr()


@pytest.mark.token_offers("GENERATE_KEY")  # keys rotate without --new-kek-label makes one
def test_status_after_keys_rotate_checks_the_kek_the_keystore_records(
    softhsm_token: SoftHsmToken, local_relay: str, tmp_path: Path
) -> None:
    """After `keys rotate` ([pkcs11] kek_label unchanged, the new KEK in the keystore), the
    daemon serves under the new KEK and `status` checks that one: exit 0, token ok."""
    token = softhsm_token.config(kek_label=f"status-rot-{tmp_path.name}"[:50])
    socket_path = tmp_path / "b.sock"
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=tmp_path / "state",
                          socket=socket_path, relay_url=local_relay)
    assert _cli(config, "keys", "init").returncode == 0
    assert _cli(config, "agent", "create", "--owner", TestKey().pubkey,
                "--name", "r").returncode == 0
    rotated = _cli(config, "keys", "rotate")
    assert rotated.returncode == 0, rotated.stderr
    new = re.search(rf"KEK '({re.escape(token.kek_label)}-[0-9a-f]{{8}})'", rotated.stdout)
    assert new, rotated.stdout

    with _serving(config, socket_path) as daemon:
        running = _cli(config, "status", "--json")
        assert running.returncode == 0, running.stdout + running.stderr
        facts = json.loads(running.stdout)
        assert facts["token"] == {"ok": True, "detail": (
            f"logged in to {token.token_label!r} (PIN from [pkcs11] pin_file); KEK "
            f"{new[1]!r} found and checked (the active KEK the keystore records, not "
            f"[pkcs11] kek_label {token.kek_label!r})")}
        assert (facts["ok"], facts["exit"], facts["agents"]["live"]) == (True, 0, 1)
        text = _cli(config, "status")
        assert text.returncode == 0 and re.search(r"^token: +logged in", text.stdout, re.M)
    assert daemon.returncode == 0
