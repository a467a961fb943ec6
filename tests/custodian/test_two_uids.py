"""Under two uids the pipeline holds nothing of the keys: it does not map the PKCS#11 module,
cannot open the PIN file, the token's files nor the keystore, and after signing with a
freshly imported random key that key is nowhere in its memory. Each fact is checked on the
layout the units ship (the custodian under its own uid) and, as the control that shows the
check can fail, on the in-process layout (custody inside the daemon), where each one is
false. The agent flows still work there: the key is imported through the custodian, and
the daemon's uid issues a credential, posts a message and lists the agent (`agent list`,
`status`) from the custodian's records.

Needs root (it runs the daemon and the custodian as two uids other than its own, and reads
/proc/<pid>/mem): skipped otherwise, saying so. The uids: the daemon runs as nobody (65534),
the custodian as the first uid from 64100 on with no passwd entry (numeric: nothing is
added to /etc/passwd). The layout mirrors docs/custodian.md "Who can do what": the
custodian's home, token directory, keystore directory and PIN file are its alone (0700,
0600), with no grant to the pipeline's group; the pipeline's group reaches only the
custodian's socket. The custodian's own command makes the KEK (`custodian FILE keys init`,
under its uid), as docs/install.md does.

The unsealed-key cache is on in both layouts ([pkcs11] unsealed_cache_entries): it keeps
the unsealed key resident in whichever process signs, so the memory scan finds it in the
in-process daemon and in the custodian (the control scan of the custodian: it finds it
there), and must not find it in the pipeline. With the cache off, that nothing of the key
stays in the custodian either is tests/custodian/test_custodian_memory.py's (the same scan,
tests/fixtures/memscan.py).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import coincurve
import pytest

from tests.custodian.test_refusals import ask
from tests.fixtures.memscan import maps, memory_holds
from tests.fixtures.stop import terminate_then_kill

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
MODULE_NAME = "libsofthsm2"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=(
    "needs root: runs the daemon and the custodian as two other uids and reads their "
    "/proc/<pid>/mem (CI runs as root)"))


def _free_uid() -> int:
    for uid in range(64100, 64400):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free uid in 64100..64399")


def _as(uid: int, gid: int, groups: tuple[int, ...] = ()) -> list[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) not installed")
    group_flag = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", *group_flag, "--"]


def _env(**extra: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "MALLOC_ARENA_MAX": "2", "PYTHONDONTWRITEBYTECODE": "1"}
    if "BUZZ_SHARED_DIR" in os.environ:
        env["BUZZ_SHARED_DIR"] = os.environ["BUZZ_SHARED_DIR"]
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], stdin: bytes | None = None) -> str:
    done = subprocess.run(argv, env=env, cwd=REPO, input=stdin, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, (argv, done.stderr.decode(errors="replace")[-2000:])
    return done.stdout.decode().strip()


def _toml(tables: dict[str, dict[str, object]]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
                   for name, t in tables.items())


def _wait(path: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.is_socket():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{path} not bound: {log.read_text()[-3000:]}"
        time.sleep(0.05)


def _post(sock_path: Path, credential: str, channel: str) -> dict[str, object]:
    body = json.dumps({"type": "broker_request", "protocolVersion": 1,
                       "requestId": f"two-uids-{uuid.uuid4()}", "actionVersion": 1,
                       "action": "message.post",
                       "args": {"channelId": channel, "content": "signed across two uids"}}
                      ).encode()
    head = (f"POST /v1/action HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer {credential}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(str(sock_path))
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    answer: dict[str, object] = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return answer


@dataclass(frozen=True)
class Layout:
    name: str
    daemon_pid: int
    daemon_uid: int
    daemon_gid: int
    custodian_pid: int | None
    custodian_socket: Path | None
    pin_file: Path
    token_dir: Path
    keystore: Path
    agent: str
    daemon_cli: tuple[str, ...]
    daemon_env: dict[str, str]
    secret: bytes
    answer: dict[str, object]


def _groups(layout: Layout) -> tuple[int, ...]:
    return tuple(os.getgrouplist(pwd.getpwuid(NOBODY).pw_name, layout.daemon_gid)) \
        if layout.name == "in-process" else (layout.daemon_gid,)


def _can_open(layout: Layout) -> dict[str, bool]:
    """What the daemon's uid and groups can open: the PIN file, the token directory, each
    token file (tried in a process with exactly the daemon's credentials)."""
    probe = ("import json, os, sys\n"
             "pin, tokens = sys.argv[1], sys.argv[2]\n"
             "out = {}\n"
             "def tryit(name, f):\n"
             "    try: f(); out[name] = True\n"
             "    except PermissionError: out[name] = False\n"
             "tryit('pin', lambda: open(pin, 'rb').close())\n"
             "tryit('token dir', lambda: os.listdir(tokens))\n"
             "print(json.dumps(out))\n")
    groups = _groups(layout)
    out = json.loads(_run([*_as(layout.daemon_uid, layout.daemon_gid, groups),
                           sys.executable, "-c", probe, str(layout.pin_file),
                           str(layout.token_dir)], _env()))
    files = [p for p in layout.token_dir.rglob("*") if p.is_file()]
    assert files, "the token has files"
    probe_files = ("import sys\nok = []\nfor p in sys.argv[1:]:\n"
                   "    try: open(p, 'rb').close(); ok.append(p)\n"
                   "    except PermissionError: pass\nprint(len(ok))\n")
    opened = int(_run([*_as(layout.daemon_uid, layout.daemon_gid, groups), sys.executable,
                       "-c", probe_files, *map(str, files)], _env()))
    out["token files"] = opened > 0
    return {k: bool(v) for k, v in out.items()}


@pytest.fixture(scope="module", params=["custodian", "in-process"])
def layout(request: pytest.FixtureRequest, local_relay: str) -> Iterator[Layout]:
    """A daemon (uid nobody) that signed one message.post with a freshly imported random
    key; with `custodian`, the keys are a custodian's under another uid."""
    separated = request.param == "custodian"
    base = Path(tempfile.mkdtemp(prefix="buzz-two-uids-", dir="/tmp"))
    base.chmod(0o711)
    procs: list[subprocess.Popen[bytes]] = []
    d_uid = d_gid = NOBODY
    k_uid = _free_uid() if separated else d_uid
    k_gid = k_uid if separated else d_gid
    try:
        # The key holder's side: its directory, token, PIN, keystore.
        keys_home = base / ("custodian" if separated else "daemon")
        keys_home.mkdir(mode=0o700)
        os.chown(keys_home, k_uid, k_gid)
        holder = _as(k_uid, k_gid)
        facts = dict(line.split("=", 1) for line in _run(
            [*holder, sys.executable, str(REPO / "softhsm" / "make-token"),
             str(keys_home / "softhsm"), "--label", "two-uids"], _env()).splitlines()
            if "=" in line)
        token_env = _env(SOFTHSM2_CONF=facts["SOFTHSM2_CONF"])
        keystore_dir = keys_home / "keys" if separated else keys_home / "state"
        keystore_dir.mkdir(mode=0o700)
        os.chown(keystore_dir, k_uid, k_gid)
        pkcs11 = {"module": facts["module"], "token_label": facts["token_label"],
                  "pin_file": facts["pin_file"], "unsealed_cache_entries": 16,
                  "unsealed_cache_seconds": 600}
        run_dir = base / "run"
        custodian_socket = run_dir / "custodian.sock" if separated else None
        custodian_config = keys_home / "custodian.toml"
        if separated:
            # The KEK: the custodian's own command, under its uid, from its own file.
            custodian_config.write_text(_toml({
                "custodian": {"socket": str(custodian_socket), "pipeline_uid": d_uid,
                              "state_dir": str(keystore_dir), "relay_url": local_relay},
                "pkcs11": pkcs11}))
            os.chown(custodian_config, k_uid, k_gid)
            _run([*holder, sys.executable, "-m", "custody.custodian", str(custodian_config),
                  "keys", "init"], token_env)
        else:
            cli_config = keys_home / "cli.toml"
            cli_config.write_text(_toml({"state": {"dir": str(keystore_dir)}, "pkcs11": pkcs11,
                                         "relay": {"url": local_relay}}))
            os.chown(cli_config, k_uid, k_gid)
            _run([*holder, sys.executable, "-m", "daemon.cli", "--config", str(cli_config),
                  "keys", "init"], token_env)

        # The daemon's side.
        d_home = base / "daemon" if separated else keys_home
        if separated:
            d_home.mkdir(mode=0o700)
            os.chown(d_home, d_uid, d_gid)
        state = d_home / "state"
        daemon_config: dict[str, dict[str, object]] = {
            "server": {"socket": str(d_home / "broker.sock")},
            "state": {"dir": str(state)},
            "relay": {"url": local_relay}}
        if separated:
            state.mkdir(mode=0o700)
            os.chown(state, d_uid, d_gid)
            run_dir.mkdir()
            os.chown(run_dir, k_uid, d_gid)
            run_dir.chmod(0o2750)
            log = base / "custodian.log"
            with log.open("wb") as out:  # the child keeps its own descriptor
                custodian = subprocess.Popen(
                    [*holder, sys.executable, "-m", "custody.custodian", str(custodian_config)],
                    env=token_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            procs.append(custodian)
            _wait(custodian_socket, custodian, log)
            daemon_config["custody"] = {"custodian_socket": str(custodian_socket)}
            daemon_config["pkcs11"] = {"module": facts["module"],
                                       "token_label": facts["token_label"]}
        else:
            daemon_config["pkcs11"] = pkcs11
        config_path = d_home / "broker.toml"
        config_path.write_text(_toml(daemon_config))
        os.chown(config_path, d_uid, d_gid)

        daemon_cli = [*_as(d_uid, d_gid), sys.executable, "-m", "daemon.cli", "--config",
                      str(config_path)]
        d_env = _env() if separated else token_env
        # A fresh random agent key, imported by the daemon's uid's command: through the
        # custodian's table when separated (docs/install.md runs it so), else in-process.
        secret = secrets.token_bytes(32)
        owner = coincurve.PrivateKey().public_key_xonly.format().hex()
        agent = _run([*daemon_cli, "agent", "import", "--owner", owner, "--name", "scout"],
                     d_env, stdin=secret.hex().encode() + b"\n")
        assert agent == coincurve.PrivateKey(secret).public_key_xonly.format().hex()
        channel = str(uuid.uuid4())
        credential = _run([*daemon_cli, "credential", "issue", "--agent", agent, "--channel",
                           channel, "--action", "message.post", "--ttl", "1d", "--any-uid"],
                          d_env)
        log = d_home / "broker.log"
        with log.open("wb") as err:  # the child keeps its own descriptor
            daemon = subprocess.Popen([*daemon_cli, "serve"], env=d_env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=err)
        procs.append(daemon)
        _wait(d_home / "broker.sock", daemon, log)
        answer = _post(d_home / "broker.sock", credential, channel)
        assert answer.get("status") == "succeeded", answer
        yield Layout(name=request.param, daemon_pid=daemon.pid, daemon_uid=d_uid,
                     daemon_gid=d_gid,
                     custodian_pid=procs[0].pid if separated else None,
                     custodian_socket=custodian_socket, pin_file=Path(facts["pin_file"]),
                     token_dir=Path(facts["SOFTHSM2_CONF"]).parent / "tokens",
                     keystore=keystore_dir / "keystore.db", agent=agent,
                     daemon_cli=tuple(daemon_cli), daemon_env=d_env, secret=secret,
                     answer=answer)
    finally:
        for proc in reversed(procs):
            terminate_then_kill(proc, 15)
        shutil.rmtree(base, ignore_errors=True)


def test_the_pipeline_does_not_map_the_pkcs11_module(layout: Layout) -> None:
    in_daemon = MODULE_NAME in maps(layout.daemon_pid)
    if layout.name == "custodian":
        assert not in_daemon
        assert layout.custodian_pid is not None
        assert MODULE_NAME in maps(layout.custodian_pid)  # where it is instead
    else:
        assert in_daemon  # the control: in-process, the daemon maps it


def test_the_pipeline_cannot_open_the_pin_file_or_the_token(layout: Layout) -> None:
    opened = _can_open(layout)
    print(f"\n{layout.name}: the daemon's uid can open {opened}")
    if layout.name == "custodian":
        assert opened == {"pin": False, "token dir": False, "token files": False}
    else:
        assert opened == {"pin": True, "token dir": True, "token files": True}


def test_the_pipeline_cannot_open_the_keystore(layout: Layout) -> None:
    """No grant is left: the daemon's uid and groups open neither the keystore file nor its
    directory (the daemon's records are the custodian's answers)."""
    assert layout.keystore.is_file(), "the keystore exists (root sees it)"
    probe = ("import json, os, sqlite3, sys\n"
             "path = sys.argv[1]\nout = {}\n"
             "def tryit(name, f):\n"
             "    try: f(); out[name] = True\n"
             "    except (PermissionError, sqlite3.OperationalError): out[name] = False\n"
             "tryit('keystore', lambda: open(path, 'rb').close())\n"
             "tryit('keystore dir', lambda: os.listdir(os.path.dirname(path)))\n"
             "tryit('sqlite read', lambda: sqlite3.connect(f'file:{path}?mode=ro', uri=True)"
             ".execute('SELECT count(*) FROM keys').fetchone())\n"
             "print(json.dumps(out))\n")
    opened = json.loads(_run([*_as(layout.daemon_uid, layout.daemon_gid, _groups(layout)),
                              sys.executable, "-c", probe, str(layout.keystore)], _env()))
    print(f"\n{layout.name}: the daemon's uid can open {opened}")
    expected = layout.name != "custodian"  # the control: in-process it is the daemon's file
    assert opened == {"keystore": expected, "keystore dir": expected, "sqlite read": expected}


def test_the_agent_flows_work_from_the_custodians_records(layout: Layout) -> None:
    """The daemon's uid signed a message.post (the fixture), and lists the agent the
    custodian holds: `agent list` and `status` read the records through its table."""
    assert layout.answer.get("status") == "succeeded"
    listed = [json.loads(line) for line in _run(
        [*layout.daemon_cli, "agent", "list", "--json"], layout.daemon_env).splitlines()]
    print(f"\n{layout.name}: agent list {listed}")
    assert [(a["pubkey"], a["name"]) for a in listed] == [(layout.agent, "scout")], listed
    done = subprocess.run([*layout.daemon_cli, "status", "--json"], env=layout.daemon_env,
                          cwd=REPO, capture_output=True, timeout=120)
    facts = json.loads(done.stdout)
    assert facts["agents"]["live"] == 1 and facts["agents"]["deleted"] == 0, facts
    assert facts["credentials"]["active"] == 1, facts


def test_no_agent_secret_in_the_pipelines_memory_after_signing(layout: Layout) -> None:
    needles = (layout.secret, layout.secret.hex().encode())
    in_daemon = memory_holds(layout.daemon_pid, needles)
    if layout.name == "custodian":
        assert not in_daemon
        assert layout.custodian_pid is not None
        # The control scan: the custodian signed, and its cache holds the key.
        assert memory_holds(layout.custodian_pid, needles)
    else:
        assert in_daemon  # the control: the in-process daemon holds the unsealed key


@pytest.mark.parametrize("layout", ["custodian"], indirect=True)
def test_a_peer_of_another_uid_is_refused(layout: Layout) -> None:
    assert layout.custodian_socket is not None
    # This test's own uid (root) is not the pipeline's: refused though root may connect.
    ok, value = ask(layout.custodian_socket, "records_version")
    assert not ok and value[0] == "refused", value  # type: ignore[index]
    assert re.search(r"uid", str(value[1]))  # type: ignore[index]


def test_the_pipeline_is_hardened_in_either_layout(layout: Layout) -> None:
    # With a custodian the daemon never opens custody, which is what hardened it (found by
    # a secrets review: its core held agents' credentials and decrypted memory). Now every
    # buzz-broker process hardens itself first: no core file, and undumpable (its /proc
    # entries pass to root, so same-uid peers cannot read its memory).
    limits = Path(f"/proc/{layout.daemon_pid}/limits").read_text()
    [core] = [line.split()[4:6] for line in limits.splitlines()
              if line.startswith("Max core file size")]
    assert core == ["0", "0"], (layout.name, core)
    assert layout.daemon_uid != 0
    assert Path(f"/proc/{layout.daemon_pid}/environ").stat().st_uid == 0, layout.name
