"""The action API on loopback TCP ([server] listen_tcp, issue 24 item 1).

The real daemon (a child process: real SoftHSM token, LocalRelay, its own socket and TCP
listener) wherever the behaviour is the daemon's: the peer uid over TCP, the allow-list,
the browser rule, the credential rule, the Buzz-side client. Clients "from another uid"
are stdlib Python children that drop to uid/gid 65534 (nobody) before they make their
socket: the kernel records a socket's owner when it is created (daemon/tcp_peer.py).
Unit-level where the rule is one module's: the squatting rule and socket activation
(`run_server` with a fake application), the per-credential cap and the metrics listener
(`daemon.http.serve`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from custody import TokenConfig
from daemon.cli._common import CliError
from daemon.cli import serve as serve_cli
from daemon.cli.check_config import describe_tcp
from daemon.cli.serve import METRICS_NOTE
from daemon.config import METRICS_TCP, load_config
from daemon.http import (HttpAnswer, HttpLimits, HttpRequest, action_routes, bind_tcp_socket,
                         bind_unix_socket, serve)
from daemon import http, loopback_tcp
from daemon.loopback_tcp import (HELD_BY_SYSTEMD, MEMBERSHIP_STALE, MEMBERSHIP_TTL, AdmissionGate,
                                 TcpAdmission)
from daemon.metrics import SCRAPE_LIMITS, Metrics, scrape_routes
from daemon.state.audit import AUDIT_DIRNAME, audit_files
from daemon.state.sessions import SessionStore
from daemon import tcp_peer
from daemon.tcp_peer import peer_uid
from tests.adversarial._daemon import DaemonProcess, post, request_body, setup_state
from tests.fixtures.broker import write_config
from tests.fixtures.relay import free_port
from tests.fixtures.stop import terminate_then_kill
from tests.test_serve import FakeApp, fake_factory, no_lock

from buzzwire.contract import ACTIONS
from buzz_broker_client import BrokerClient

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
CHANNEL = "0b6f6a1e-0000-4000-8000-0000000000c4"
#: A Python uid 65534 can execute (the venv's may sit under a directory only root enters).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or SYSTEM_PYTHON is None,
    reason="needs root and a system python3 to run a client as uid 65534")

#: The client another uid runs: drop to `uid` *before* the socket exists, then send the
#: request bytes given in hex (none: send nothing) and print what came back, as JSON.
CHILD = r"""
import json, os, socket, sys
uid, port, request = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
if uid != os.getuid():
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
s = socket.create_connection(("127.0.0.1", port), timeout=10)
if request:
    s.sendall(request)
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except ConnectionResetError:
        break
    if not chunk:
        break
    data += chunk
    head, sep, body = data.partition(b"\r\n\r\n")
    if sep:
        length = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
        if length and len(body) >= length[0]:
            break
head, _, body = data.partition(b"\r\n\r\n")
print(json.dumps({"head": head.decode("latin-1"), "body": body.decode("utf-8", "replace")}))
"""


def http_request(port: int, body: bytes, credential: str | None, *,
                 host: str | None = None, extra: str = "") -> bytes:
    """Exact request bytes: Host as Buzz's transport sends it unless `host` says otherwise."""
    head = f"POST /v1/action HTTP/1.1\r\nHost: {host or f'127.0.0.1:{port}'}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if credential is not None:
        head += f"Authorization: Bearer {credential}\r\n"
    return (head + extra + "\r\n").encode() + body


async def as_uid(uid: int, port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers lowercased, body) of `request` sent by a client running as `uid`."""
    assert SYSTEM_PYTHON is not None
    done = await trio.to_thread.run_sync(functools.partial(
        subprocess.run, [SYSTEM_PYTHON, "-c", CHILD, str(uid), str(port), request.hex()],
        capture_output=True, timeout=30, cwd="/"))
    assert done.returncode == 0, done.stderr.decode()
    got = json.loads(done.stdout)
    lines = got["head"].split("\r\n")
    status = int(lines[0].split()[1]) if lines[0] else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return status, headers, got["body"].encode()


def storage_address(request_id: str | None = None) -> bytes:
    return request_body("storage.address", {"slug": "core"},
                        request_id=request_id or str(uuid.uuid4()))


def outcome(body: bytes) -> tuple[str, str | None]:
    parsed: dict[str, Any] = json.loads(body)
    return parsed["status"], (parsed.get("error") or {}).get("code")


def issue(state_dir: Path, agent: str, uid: int | None) -> str:
    store = SessionStore.open(state_dir)
    try:
        _, token = store.issue(agent=agent, channels=frozenset({CHANNEL}),
                               actions=frozenset(ACTIONS), ttl_seconds=None, uid=uid,
                               now=int(time.time()))
    finally:
        store.close()
    return token


class Host:
    """One daemon with a TCP listener, its agent and credentials of every kind."""

    def __init__(self, daemon: DaemonProcess, port: int, state_dir: Path, socket_path: Path,
                 agent: str, unbound: str, root_bound: str) -> None:
        self.daemon, self.port, self.state_dir, self.socket = daemon, port, state_dir, socket_path
        self.agent, self.unbound, self.root_bound = agent, unbound, root_bound

    def audit_bytes(self) -> bytes:
        return b"".join(p.read_bytes() for _n, p in audit_files(self.state_dir / AUDIT_DIRNAME))


async def start_daemon(custody_state: tuple[TokenConfig, Path], relay: str, tmp_path: Path,
                       allowed: list[int], **server: object) -> tuple[DaemonProcess, int, Path]:
    """The daemon, with a TCP listener on a free port and `allowed` uids: (it, port, socket).

    `server` adds [server] keys."""
    token, state_dir = custody_state
    port = free_port()
    socket_path = tmp_path / "broker.sock"
    config = write_config(
        tmp_path / "broker.toml", token=token, state_dir=state_dir, socket=socket_path,
        relay_url=relay,
        sections={"server": {"listen_tcp": [f"127.0.0.1:{port}"],
                             # a free port the test picked: nobody holds it for the daemon
                             "listen_tcp_accept_squatting_risk": True,
                             "tcp_allow_uids": allowed, **server}})
    return await DaemonProcess.start(config, socket_path), port, socket_path


@pytest.fixture
async def tcp_host(custody_state: tuple[TokenConfig, Path], local_relay: str,
                   tmp_path: Path) -> AsyncIterator[Host]:
    token, state_dir = custody_state
    agent = await setup_state(token, state_dir, [CHANNEL])
    root_bound = issue(state_dir, agent.agent, 0)
    daemon, port, socket_path = await start_daemon(custody_state, local_relay, tmp_path,
                                                   [0, NOBODY])
    try:
        yield Host(daemon, port, state_dir, socket_path, agent.agent, agent.credential,
                   root_bound)
    finally:
        await daemon.stop()


# --------------------------------------------------------------------------- the real daemon


@needs_root
async def test_uid_bound_credential_refused_from_another_uid(tcp_host: Host) -> None:
    """A credential bound to uid 0 holds over TCP as over SO_PEERCRED: uid 65534 sending
    the very same header is unauthenticated; uid 0 is answered."""
    request = http_request(tcp_host.port, storage_address(), tcp_host.root_bound)
    status, _, body = await as_uid(NOBODY, tcp_host.port, request)
    assert status == 200 and outcome(body) == ("failed", "unauthenticated")
    request = http_request(tcp_host.port, storage_address(), tcp_host.root_bound)
    status, _, body = await as_uid(0, tcp_host.port, request)
    assert status == 200 and outcome(body)[0] == "succeeded", body


#: A client of another uid that sends its request and closes at once, not waiting.
SEND_AND_GO = r"""
import os, socket, sys
uid, port, request = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(request)
s.close()
"""


@needs_root
async def test_a_client_gone_before_the_lookup_is_not_root(tcp_host: Host) -> None:
    """uid 65534 sends a request with a root-bound credential and closes before the daemon
    accepts: its socket is then a TIME-WAIT entry, which the kernel reports as uid 0. The
    daemon must not read that as root: the request is refused unjudged (nothing audited),
    while the same request from a live uid-0 client is answered and counted."""
    assert SYSTEM_PYTHON is not None
    request = http_request(tcp_host.port, storage_address(), tcp_host.root_bound)
    os.kill(tcp_host.daemon.pid, signal.SIGSTOP)  # the kernel still completes connects
    try:
        done = await trio.to_thread.run_sync(functools.partial(
            subprocess.run, [SYSTEM_PYTHON, "-c", SEND_AND_GO, str(NOBODY), str(tcp_host.port),
                             request.hex()], capture_output=True, timeout=30, cwd="/"))
        assert done.returncode == 0, done.stderr.decode()
        await trio.sleep(0.2)  # the client's FIN acknowledged: its end is TIME-WAIT now
    finally:
        os.kill(tcp_host.daemon.pid, signal.SIGCONT)
    with trio.move_on_after(10):  # the refusal is logged; on old code it never comes
        while '"event":"tcp_refused"' not in tcp_host.daemon.log():
            await trio.sleep(0.05)
    status, _, body = await as_uid(0, tcp_host.port,
                                   http_request(tcp_host.port, storage_address(),
                                                tcp_host.root_bound))
    assert status == 200 and outcome(body)[0] == "succeeded", body
    assert await tcp_host.daemon.stop() == 0  # every record written
    counted = [json.loads(line) for line in tcp_host.audit_bytes().splitlines()
               if b'"phase":"reads"' in line and b'"storage.address"' in line]
    assert sum(line["count"] for line in counted) == 1  # the live client's, not the gone one's
    assert '"event":"tcp_refused"' in tcp_host.daemon.log()


@needs_root
async def test_credential_without_uid_refused_over_tcp(tcp_host: Host) -> None:
    """Over TCP only uid-bound credentials authenticate (tcp_allow_credentials_without_uid
    is false); the same credential still works on the Unix socket."""
    status, _, body = await as_uid(0, tcp_host.port,
                                   http_request(tcp_host.port, storage_address(), tcp_host.unbound))
    assert status == 200 and outcome(body) == ("failed", "unauthenticated")
    answer = await post(tcp_host.socket, storage_address(), tcp_host.unbound)
    assert answer is not None and outcome(answer.body)[0] == "succeeded", answer


@needs_root
async def test_credential_without_uid_accepted_over_tcp_when_allowed(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    """tcp_allow_credentials_without_uid = true is the operator's opt-in: a credential
    issued without `--uid` then authenticates over TCP as it does on the socket."""
    token, state_dir = custody_state
    agent = await setup_state(token, state_dir, [CHANNEL])
    daemon, port, _socket = await start_daemon(custody_state, local_relay, tmp_path, [0],
                                               tcp_allow_credentials_without_uid=True)
    try:
        status, _, body = await as_uid(0, port, http_request(port, storage_address(),
                                                             agent.credential))
        assert status == 200 and outcome(body) == ("succeeded", None), body
    finally:
        await daemon.stop()


#: Node's global fetch (undici 6, node 20) as it sends a POST, header for header: the
#: Sec-Fetch-Mode it always adds is the browser rule's.
NODE_FETCH = ("connection: keep-alive\r\naccept: */*\r\naccept-language: *\r\n"
              "sec-fetch-mode: cors\r\nuser-agent: node\r\naccept-encoding: gzip, deflate\r\n")

BROWSER_LIKE = [
    pytest.param({"extra": "Origin: http://evil.example\r\n", "rule": "BROWSER"}, id="origin"),
    pytest.param({"extra": "Origin: null\r\n", "rule": "BROWSER"}, id="origin-null"),
    pytest.param({"extra": "Sec-Fetch-Site: cross-site\r\nSec-Fetch-Mode: no-cors\r\n",
                  "rule": "BROWSER"}, id="sec-fetch"),
    pytest.param({"extra": NODE_FETCH, "rule": "BROWSER"}, id="node-fetch"),
    pytest.param({"extra": "Upgrade: websocket\r\nConnection: Upgrade\r\n", "rule": "BROWSER"},
                 id="upgrade"),
    pytest.param({"host": "evil.example", "rule": "HOST"}, id="rebound-host"),
    pytest.param({"host": "evil.example:{port}", "extra": "Origin: http://evil.example\r\n",
                  "rule": "HOST"}, id="rebound-host-port"),
    pytest.param({"host": "127.0.0.1", "rule": "HOST"}, id="no-port"),
    pytest.param({"host": "127.0.0.1:1", "rule": "HOST"}, id="other-port"),
    pytest.param({"host": "127.0.0.2:{port}", "rule": "HOST"}, id="other-loopback"),
    # h11 refuses two Host headers itself (400, malformed HTTP), before this layer sees the
    # request: a bare 400, like every malformed request's.
    pytest.param({"host": "127.0.0.1:{port}\r\nHost: evil.example", "status": "400"},
                 id="two-hosts"),
]


@needs_root
@pytest.mark.parametrize("variant", BROWSER_LIKE)
async def test_browser_requests_refused_without_reaching_the_pipeline(
        tcp_host: Host, variant: dict[str, str]) -> None:
    """What a page could send (an Origin, Sec-Fetch-*, Upgrade, or a Host other than the
    listener's own loopback literal) is a 403 whose text/plain body is the fixed line
    naming the rule broken (nothing the request held: no Host, Origin, credential or
    requestId), no CORS header, and nothing in the audit log - though the credential is
    valid and the same request, sent as an agent sends it, succeeds and is audited."""
    port = tcp_host.port
    refused_id = f"browser-{uuid.uuid4()}"
    host = variant.get("host", "").replace("{port}", str(port)) or None
    request = http_request(port, storage_address(refused_id), tcp_host.root_bound, host=host,
                           extra=variant.get("extra", ""))
    status, headers, body = await as_uid(0, port, request)
    if "rule" in variant:
        expected = loopback_tcp.Refusal[variant["rule"]].value
        assert (status, body, headers.get("content-type")) == (403, expected, "text/plain")
    else:
        assert (status, body) == (int(variant["status"]), b"")
    assert not [h for h in headers if h.startswith("access-control-")]
    assert headers.get("connection") == "close"
    accepted_id = f"agent-{uuid.uuid4()}"
    for literal in (f"127.0.0.1:{port}", f"localhost:{port}"):
        request = http_request(port, storage_address(f"{accepted_id}-{literal[0]}"),
                               tcp_host.root_bound, host=literal)
        status, headers, body = await as_uid(0, port, request)
        assert status == 200 and outcome(body)[0] == "succeeded", body
        assert not [h for h in headers if h.startswith("access-control-")]
    assert await tcp_host.daemon.stop() == 0  # every record written
    audit = tcp_host.audit_bytes()
    # A read that ran is counted, not listed (issue 24): the two accepted, not the refused.
    counted = [json.loads(line) for line in audit.splitlines()
               if b'"phase":"reads"' in line and b'"storage.address"' in line]
    assert sum(line["count"] for line in counted) == 2
    assert refused_id.encode() not in audit


#: Node's global fetch, then node:http with the same bytes, against the TCP listener:
#: what each got, as JSON. The credential comes from a file, never argv.
NODE_BOTH_WAYS = r"""
const http = require("node:http"); const fs = require("node:fs");
const [port, credentialFile, requestId, channel] = process.argv.slice(1);
const credential = fs.readFileSync(credentialFile, "utf8").trim();
const body = Buffer.from(JSON.stringify({type: "broker_request", protocolVersion: 1, requestId,
  actionVersion: 1, action: "storage.address", args: {slug: "core"}}));
const headers = {Authorization: `Bearer ${credential}`, "Content-Type": "application/json"};
(async () => {
  const res = await fetch(`http://127.0.0.1:${port}/v1/action`, {method: "POST", body, headers});
  const fetched = {status: res.status, contentType: res.headers.get("content-type"),
    cors: [...res.headers.keys()].filter((k) => k.startsWith("access-control-")), body: await res.text()};
  const viaHttp = await new Promise((resolve, reject) => {
    const req = http.request({host: "127.0.0.1", port: Number(port), path: "/v1/action", method: "POST",
      headers: {...headers, "Content-Length": body.length}}, (r) => {
      const chunks = []; r.on("data", (c) => chunks.push(c));
      r.on("end", () => resolve({status: r.statusCode, body: Buffer.concat(chunks).toString("utf8")}));
    });
    req.on("error", reject); req.end(body);
  });
  console.log(JSON.stringify({fetched, viaHttp}));
})();
"""


@needs_root
async def test_nodes_fetch_is_refused_by_name_and_node_http_is_served(tcp_host: Host,
                                                                      tmp_path: Path) -> None:
    """Node's built-in fetch always sends Sec-Fetch-Mode: the listener answers it 403 with
    the browser rule's fixed line (an empty 403 read as "no answer" would be retried for
    ever), and node:http, which adds no such header, is served the same bytes' envelope:
    the way docs/protocol.md §1 sends a Node agent."""
    node = shutil.which("node")
    assert node is not None, "node is missing: `make deps` installs nodejs"
    credential = tmp_path / "credential"
    credential.write_text(tcp_host.root_bound)
    credential.chmod(0o600)
    request_id = f"node-{uuid.uuid4()}"
    done = await trio.run_process([node, "-e", NODE_BOTH_WAYS, str(tcp_host.port), str(credential),
                                   request_id, CHANNEL], capture_stdout=True, capture_stderr=True,
                                  check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = json.loads(done.stdout)
    assert got["fetched"] == {"status": 403, "contentType": "text/plain", "cors": [],
                              "body": loopback_tcp.Refusal.BROWSER.value.decode()}
    assert got["viaHttp"]["status"] == 200
    envelope = json.loads(got["viaHttp"]["body"])
    assert (envelope["requestId"], envelope["status"]) == (request_id, "succeeded")


async def test_uid_not_allowed_refused_before_a_byte(
        custody_state: tuple[TokenConfig, Path], local_relay: str, tmp_path: Path) -> None:
    """A peer uid not in tcp_allow_uids/tcp_allow_groups gets 403 before it sends anything."""
    if os.geteuid() != 0 or SYSTEM_PYTHON is None:
        pytest.skip("needs root and a system python3 to run a client as uid 65534")
    daemon, port, _socket = await start_daemon(custody_state, local_relay, tmp_path, [0])
    try:
        status, headers, body = await as_uid(NOBODY, port, b"")  # sends no byte at all
        assert (status, body, headers.get("connection")) == (403, loopback_tcp.Refusal.UID.value,
                                                             "close")
        assert headers.get("content-type") == "text/plain"
        # uid 0 is allowed: the same listener answers it (a route refusal, not a 403).
        status, _, _ = await as_uid(0, port, f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                             "Connection: close\r\n\r\n".encode())
        assert status == 404
    finally:
        await daemon.stop()
    assert '"event":"tcp_refused"' in daemon.log()


async def test_buzz_client_over_tcp_end_to_end(tcp_host: Host) -> None:
    """The agent-side client takes `http://127.0.0.1:P` and `http://localhost:P` base URLs
    (as Buzz's transport does) and a call over TCP gets its verdict."""
    for base in (f"http://127.0.0.1:{tcp_host.port}", f"http://localhost:{tcp_host.port}"):
        def call(base: str = base) -> Any:
            with BrokerClient(base, tcp_host.root_bound) as client:
                return client.storage_address("core")

        answer = await trio.to_thread.run_sync(call)
        assert type(answer).__name__ == "Succeeded", answer
        assert answer.action == "storage.address" and answer.outcome.d_tag


# --------------------------------------------------------------------------- unit level


@pytest.fixture
def sockdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="bbt", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tcp_config(sockdir: str, extra: str) -> Path:
    path = Path(sockdir) / "broker.toml"
    path.write_text(f'[server]\nsocket = "b.sock"\nshutdown_grace = 2\ntcp_allow_uids = [0]\n'
                    f'{extra}\n[state]\ndir = "state"\n')
    return path


async def test_unheld_port_refused_without_opt_in(sockdir: str) -> None:
    """A port >= 1024 that systemd did not pass is squattable: serve refuses it, one line,
    and check-config says so."""
    port = free_port()
    config = load_config(str(tcp_config(sockdir, f'listen_tcp = ["127.0.0.1:{port}"]')),
                         environ={})
    with pytest.raises(CliError, match=r"listen_tcp 127\.0\.0\.1:\d+: port \d+ is not held"):
        await serve_cli.run_server(config, fake_factory(FakeApp()), environ={},
                                   memory_lock=no_lock)
    assert not os.path.exists(config.server.socket), "the socket bound first is gone again"
    assert "served only if systemd passes it" in describe_tcp(config)[0]


def test_check_config_names_each_rule(sockdir: str) -> None:
    accepted = load_config(str(tcp_config(
        sockdir, 'listen_tcp = ["[::1]:7475", "127.0.0.1:80"]\n'
                 "listen_tcp_accept_squatting_risk = true")), environ={})
    lines = describe_tcp(accepted)
    assert "accepted the squatting risk" in lines[0] and "[::1]:7475" in lines[0]
    assert "privileged port" in lines[1]
    assert "uid-bound credentials only" in lines[2]


#: A service manager by hand: the descriptors named before the config path to fds 3, 4, ...
#: (the Unix socket first), LISTEN_FDS their count. The app has a metrics registry, so
#: [metrics] listen is served as the broker's is.
ACTIVATED = """
import functools, os, sys
fds = sys.argv[1:-1]
for at, fd in enumerate(fds, start=3):
    os.dup2(int(fd), at)
os.environ["LISTEN_PID"] = str(os.getpid()); os.environ["LISTEN_FDS"] = str(len(fds))
import trio
from daemon.config import load_config
from daemon.log import setup_logging
from daemon.metrics import Metrics
from daemon.cli.serve import run_server
from tests.test_serve import FakeApp, fake_factory, no_lock
app = FakeApp()
app.metrics = Metrics(actions=("message.post",))
config = load_config(sys.argv[-1])
setup_logging(config.log.level)
sys.exit(trio.run(functools.partial(run_server, config, fake_factory(app), memory_lock=no_lock)))
"""


def _activated(sockdir: str, config: Path, *tcp: socket.socket) -> subprocess.Popen[bytes]:
    """`serve` as systemd starts it, with the agents' socket and `tcp` passed."""
    unix = bind_unix_socket(os.path.join(sockdir, "activated.sock"))
    passed = (unix, *tcp)
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    with unix:
        return subprocess.Popen(
            [sys.executable, "-c", ACTIVATED, *(str(s.fileno()) for s in passed), str(config)],
            pass_fds=tuple(s.fileno() for s in passed), cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("listed", [True, False])
def test_socket_activated_tcp_port_is_held(sockdir: str, listed: bool) -> None:
    """A TCP socket systemd passes is held for us: served without the opt-in, under the
    per-credential cap. One the config does not list is refused with one line (the config
    says whether TCP is on)."""
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    # One connection per credential: the daemon applies [server]
    # max_connections_per_credential to its TCP listener.
    path = tcp_config(sockdir, f'listen_tcp = ["127.0.0.1:{port}"]\n'
                               "max_connections_per_credential = 1" if listed else "")
    with tcp:
        proc = _activated(sockdir, path, tcp)
    try:
        if not listed:
            assert proc.wait(timeout=20) != 0
            assert proc.stderr is not None
            assert (b"that neither [server] listen_tcp nor [metrics] listen names"
                    in proc.stderr.read())
            return
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(http_request(port, b'{"x":1}', "tok"))
            answer = client.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            with socket.create_connection(("127.0.0.1", port), timeout=10) as second:
                second.sendall(http_request(port, b'{"x":1}', "tok"))
                assert second.recv(65536).startswith(b"HTTP/1.1 503 ")
    finally:
        terminate_then_kill(proc, 20)
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "held by systemd" in log


def test_socket_activated_metrics_port_is_held(sockdir: str) -> None:
    """buzz-broker-metrics.socket: the TCP socket systemd passes on [metrics] listen's
    address is the scrape listener (told apart from listen_tcp's by address), served as held
    by systemd without the opt-in, beside an action API port passed with it."""
    action, scrape = bind_tcp_socket("127.0.0.1", 0), bind_tcp_socket("127.0.0.1", 0)
    port, metrics_port = action.getsockname()[1], scrape.getsockname()[1]
    path = tcp_config(sockdir, f'listen_tcp = ["127.0.0.1:{port}"]\n'
                               f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"')
    with action, scrape:
        proc = _activated(sockdir, path, scrape, action)
    try:
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=10) as client:
            client.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{metrics_port}\r\n"
                           "Connection: close\r\n\r\n".encode())
            answer = b"".join(iter(lambda: client.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 200 ") and b"buzz_broker_build_info" in answer
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(http_request(port, b'{"x":1}', "tok"))
            assert client.recv(65536).startswith(b"HTTP/1.1 200 ")
        state = Path(sockdir) / "state"
        note = (state / METRICS_NOTE).read_text()
        assert note == f"127.0.0.1:{metrics_port} ({HELD_BY_SYSTEMD})\n", note
    finally:
        terminate_then_kill(proc, 20)
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert f"127.0.0.1:{metrics_port} ({HELD_BY_SYSTEMD})" in log, log[-2000:]  # serve.metrics
    assert not (state / METRICS_NOTE).exists()


@pytest.mark.parametrize("squatted", [False, True])
def test_the_other_loopback_of_a_served_port_is_held_or_said_taken(sockdir: str,
                                                                    squatted: bool) -> None:
    """`localhost` names [::1] too (first, with Debian's /etc/hosts): a port served on
    127.0.0.1 alone would leave [::1] of it to any local user, and an agent configured with
    `localhost` would send it its credential. The daemon holds it unlistened (a client is
    refused at once and goes on to 127.0.0.1), and one another process took first is a
    warning, a line of the TCP note and a failed `status` fact."""
    from daemon.cli.serve import SIBLING_TAKEN, TCP_NOTE
    from daemon.cli.status import _tcp

    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    squatter = bind_tcp_socket("::1", port) if squatted else None
    path = tcp_config(sockdir, f'listen_tcp = ["127.0.0.1:{port}"]')
    with tcp:
        proc = _activated(sockdir, path, tcp)
    state = Path(sockdir) / "state"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(http_request(port, b'{"x":1}', "tok"))
            assert client.recv(65536).startswith(b"HTTP/1.1 200 ")
        note = (state / TCP_NOTE).read_text().splitlines()
        fact = _tcp(load_config(str(path), environ={}), state, True)
        if squatted:
            assert len(note) == 2 and note[1].startswith(f"[::1]:{port} {SIBLING_TAKEN}"), note
            assert f"use http://127.0.0.1:{port}" in note[1]
            assert not fact.ok
        else:
            assert len(note) == 1 and fact.ok, note
            with socket.socket(socket.AF_INET6) as other, pytest.raises(OSError) as taken:
                other.bind(("::1", port))
            assert taken.value.errno == errno.EADDRINUSE, "nobody else may bind it meanwhile"
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("::1", port), timeout=10)
    finally:
        terminate_then_kill(proc, 20)
        if squatter is not None:
            squatter.close()
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert ('"serve.tcp_sibling_taken"' in log) is squatted, log[-2000:]
    if not squatted:
        with socket.socket(socket.AF_INET6) as after:
            after.bind(("::1", port))  # let go with the daemon


async def test_unheld_metrics_port_refused_without_opt_in(sockdir: str) -> None:
    """[metrics] listen on a port >= 1024 that systemd did not pass: serve refuses it, one
    line naming the key, the risk and both ways out, before the app opens (as listen_tcp's)."""
    port = free_port()
    config = load_config(str(tcp_config(sockdir, f'[metrics]\nlisten = "127.0.0.1:{port}"')),
                         environ={})
    app = FakeApp()
    with pytest.raises(CliError) as info:
        await serve_cli.run_server(config, fake_factory(app), environ={}, memory_lock=no_lock)
    assert str(info.value) == METRICS_TCP.refusal("127.0.0.1", port)
    assert "answer the scraper" in str(info.value) and "buzz-broker-metrics.socket" in str(info.value)
    assert not app.opened
    assert not os.path.exists(config.server.socket), "the socket bound first is gone again"


class _Echo:
    async def handle(self, request: HttpRequest) -> HttpAnswer:
        return HttpAnswer(200, b"{}")


async def _open(path: str, credential: str, scheme: str = "Bearer"
                ) -> tuple[trio.SocketStream, bytes]:
    stream = await trio.open_unix_socket(path)
    await stream.send_all(
        f"POST /v1/action HTTP/1.1\r\nHost: broker\r\nAuthorization: {scheme} {credential}\r\n"
        "Content-Length: 2\r\n\r\n{}".encode())
    return stream, await stream.receive_some(65536)


async def test_per_credential_connection_cap(sockdir: str) -> None:
    """Past max_connections_per_credential, one more connection carrying that credential is
    503 and closed, with no body and no Retry-After, and its request never reaches the
    application (docs/protocol.md §1: never acted on); another credential of the same uid
    is still served; a closed connection frees its place."""
    seen: list[HttpRequest] = []

    class Counting:
        async def handle(self, request: HttpRequest) -> HttpAnswer:
            seen.append(request)
            return HttpAnswer(200, b"{}")

    path = os.path.join(sockdir, "cap.sock")
    limits = HttpLimits(max_connections_per_credential=2, request_timeout=5)
    async with trio.open_nursery() as nursery:
        control = await nursery.start(serve, action_routes(Counting()), path, limits)
        first, a = await _open(path, "same")
        second, b = await _open(path, "same")
        third, c = await _open(path, "same")
        other, d = await _open(path, "other")
        assert a.startswith(b"HTTP/1.1 200 ") and b.startswith(b"HTTP/1.1 200 ")
        assert c.startswith(b"HTTP/1.1 503 ") and d.startswith(b"HTTP/1.1 200 ")
        assert c.endswith(b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        assert b"retry-after" not in c.lower()
        assert len(seen) == 3  # a, b and d: the refused one was never handed over
        await first.aclose()
        await trio.sleep(0.1)  # the server notices the close and releases the place
        again, e = await _open(path, "same")
        assert e.startswith(b"HTTP/1.1 200 ")
        for stream in (second, third, other, again):
            await stream.aclose()
        control.stop()


async def test_per_credential_cap_counts_every_spelling_of_the_scheme(sockdir: str) -> None:
    """The auth scheme is case-insensitive (RFC 9110 11.1; the pipeline takes `bearer` and
    `BEARER` alike), so it is one credential however it is spelt: 64 spellings of
    `Bearer` must not give one credential 64 times its cap."""
    path = os.path.join(sockdir, "cap.sock")
    limits = HttpLimits(max_connections_per_credential=2, request_timeout=5)
    async with trio.open_nursery() as nursery:
        control = await nursery.start(serve, action_routes(_Echo()), path, limits)
        held = [await _open(path, "same"), await _open(path, "same", "bearer")]
        assert all(got.startswith(b"HTTP/1.1 200 ") for _s, got in held)
        for scheme in ("BEARER", "bEaReR", "Bearer"):
            stream, got = await _open(path, "same", scheme)
            assert got.startswith(b"HTTP/1.1 503 "), scheme
            await stream.aclose()
        for stream, _got in held:
            await stream.aclose()
        control.stop()


#: Another uid holding `count` connections that each carry the credential `sys.argv[4]`:
#: it prints what each first request got, then holds them open until its stdin closes.
HOLD_CREDENTIAL = r"""
import json, os, socket, sys
uid, port, count, credential = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
held, got = [], []
for _ in range(count):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall((f"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Authorization: Bearer {credential}\r\nContent-Length: 2\r\n\r\n{{}}").encode())
    got.append(s.recv(12).decode())
    held.append(s)
print(json.dumps(got), flush=True)
sys.stdin.read()
"""


async def _open_tcp(port: int, credential: str) -> tuple[trio.SocketStream, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        f"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer "
        f"{credential}\r\nContent-Length: 2\r\n\r\n{{}}".encode())
    return stream, await stream.receive_some(65536)


@needs_root
async def test_another_uid_cannot_use_up_a_credentials_share() -> None:
    """The per-credential count is per peer uid: another allowed uid that learned a
    credential (useless to it for a uid-bound one) and holds its cap of connections with
    it leaves the owner's share whole; the owner's own connections still stop at the cap."""
    assert SYSTEM_PYTHON is not None
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    limits = HttpLimits(max_connections_per_credential=2, request_timeout=30)

    async def admit(uid: int | None) -> bool:
        return uid in (0, NOBODY)

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, action_routes(_Echo()), tcp, limits,
                                              admit=admit))
        holder = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLD_CREDENTIAL, str(NOBODY), str(port),
                                   "2", "owners-token"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, cwd="/")
        held: list[trio.SocketStream] = []
        try:
            assert holder.stdout is not None
            got = json.loads(await trio.to_thread.run_sync(holder.stdout.readline))
            assert got == ["HTTP/1.1 200"] * 2, "the other uid holds the whole cap"
            for expected in (b"HTTP/1.1 200 ", b"HTTP/1.1 200 ", b"HTTP/1.1 503 "):
                stream, answer = await _open_tcp(port, "owners-token")
                held.append(stream)
                assert answer.startswith(expected), (expected, answer)
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(10)
            for stream in held:
                await stream.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("extra", ["Origin: http://a.example\r\n", "Sec-Fetch-Mode: cors\r\n",
                                   "Upgrade: websocket\r\n"])
async def test_metrics_listener_refuses_browsers(extra: str) -> None:
    """[metrics] listen has the same browser rule: only its own Host, no browser headers;
    its 403 names the rule as the action API's does, and a HEAD gets the headers alone."""
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]

    async def scrape(text: str) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(text.encode())
            return await stream.receive_some(65536)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve, scrape_routes(Metrics(actions=ACTIONS)), tcp, SCRAPE_LIMITS)
        ok = await scrape(f"GET /metrics HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ")
        refused = await scrape(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}\r\n")
        browser = loopback_tcp.Refusal.BROWSER.value
        assert refused.startswith(b"HTTP/1.1 403 ")
        assert refused.endswith(b"\r\n\r\n" + browser)
        assert b"\r\nContent-Type: text/plain\r\n" in refused
        assert b"access-control-" not in refused.lower()
        head = await scrape(f"HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}\r\n")
        assert head.startswith(b"HTTP/1.1 403 ")
        assert head.endswith(b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(browser))
        rebound = await scrape("GET /metrics HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        assert rebound.startswith(b"HTTP/1.1 403 ")
        assert rebound.endswith(b"\r\n\r\n" + loopback_tcp.Refusal.HOST.value)
        nursery.cancel_scope.cancel()


#: (Host, listener port, accepted): RFC 9110 §7.2 has a client leave the default port 80
#: out of Host, so there, and only there, the bare loopback name is the listener's too.
HOST_ON_PORT = [
    (b"127.0.0.1", 80, True),
    (b"localhost", 80, True),
    (b"LocalHost", 80, True),
    (b"[::1]", 80, True),
    (b"127.0.0.1:80", 80, True),
    (b"[::1]:80", 80, True),
    (b"127.0.0.1", 8080, False),
    (b"localhost", 8080, False),
    (b"[::1]", 8080, False),
    (b"127.0.0.1:8080", 8080, True),
    (b"127.0.0.1:80", 8080, False),
    (b"127.0.0.1:8080", 80, False),
    (b"evil.example", 80, False),
    (b"evil.example:80", 80, False),
    (b"evil.example", 8080, False),
    (b"evil.example:8080", 8080, False),
    (b"127.0.0.2", 80, False),
    (b"::1", 80, False),
    (b"", 80, False),
]


@pytest.mark.parametrize(("host", "port", "accepted"), HOST_ON_PORT)
def test_host_without_port_names_only_a_port_80_listener(host: bytes, port: int,
                                                         accepted: bool) -> None:
    """curl and Buzz's own transport, given ``http://127.0.0.1/``, send ``Host: 127.0.0.1``:
    a listener on port 80 takes the three loopback names bare, any other port refuses
    them, and a rebinding page's own name is refused on both."""
    refused = None if accepted else loopback_tcp.Refusal.HOST
    assert loopback_tcp.browser_refusal([(b"host", host)], port) is refused
    with_origin = [(b"host", host), (b"origin", b"http://evil.example")]
    assert loopback_tcp.browser_refusal(with_origin, port) is (
        loopback_tcp.Refusal.BROWSER if accepted else loopback_tcp.Refusal.HOST)


@pytest.mark.parametrize("whole", [True, False], ids=["head-whole", "head-never-ends"])
async def test_a_browsers_oversize_head_gets_a_bare_431(whole: bool) -> None:
    """The head's size is judged before the browser rule (it must be, to parse the head at
    all), so a page whose request is too large gets 431, not 403: still a bare status, no
    body, no CORS header, the connection closed, and no handler sees it."""
    seen: list[HttpRequest] = []

    class Counting:
        async def handle(self, request: HttpRequest) -> HttpAnswer:
            seen.append(request)
            return HttpAnswer(200, b"{}")

    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    limits = HttpLimits(max_header_bytes=4096, request_timeout=5)
    head = (f"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Origin: http://page.example\r\nSec-Fetch-Mode: cors\r\n"
            f"Cookie: {'c' * 6000}\r\nContent-Length: 2\r\n").encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, action_routes(Counting()), tcp, limits)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                await stream.send_all(head + b"\r\n{}" if whole else head)
            except trio.BrokenResourceError:
                pass  # closed while we were still writing; the answer is already sent
            got = b""
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    got += chunk
        answer, _, body = got.partition(b"\r\n\r\n")
        lines = answer.split(b"\r\n")
        assert lines[0] == b"HTTP/1.1 431 Request Header Fields Too Large" and body == b""
        assert sorted(lines[1:]) == [b"Connection: close", b"Content-Length: 0"]
        assert seen == []
        nursery.cancel_scope.cancel()


#: Another uid holding as many metrics connections as it may: it opens SCRAPE_HOLD, waits
#: (up to 4 s, inside the listener's 5 s request timeout) until all but `share` of them
#: are answered, prints what each got (nothing: held; else its first bytes), and holds
#: them open until its stdin closes.
SCRAPE_HOLD = 4
HOLD_SCRAPES = r"""
import json, os, socket, sys, time
uid, port, count, share = (int(a) for a in sys.argv[1:5])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
for s in held:
    s.setblocking(False)  # with a timeout set, recv would wait for the answer
got = [""] * count
deadline = time.monotonic() + 4
while sum(map(bool, got)) < count - share and time.monotonic() < deadline:
    for i, s in enumerate(held):
        if not got[i]:
            try:
                got[i] = s.recv(12).decode()
            except BlockingIOError:
                pass
    time.sleep(0.02)
print(json.dumps(got), flush=True)
sys.stdin.read()
"""


@needs_root
async def test_one_uid_cannot_hold_every_metrics_connection() -> None:
    """Any local user can reach [metrics] listen: one uid may hold only its share of the
    scrape slots (the rest of its connections 503 at once), so another uid's scrape is
    answered at once while they are held."""
    assert SYSTEM_PYTHON is not None
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, scrape_routes(Metrics(actions=ACTIONS)), tcp, SCRAPE_LIMITS)
        share = SCRAPE_LIMITS.max_connections_per_uid
        holder = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLD_SCRAPES, str(NOBODY), str(port),
                                   str(SCRAPE_HOLD), str(share)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, cwd="/")
        try:
            assert holder.stdout is not None and holder.stdin is not None
            got = json.loads(await trio.to_thread.run_sync(holder.stdout.readline))
            assert got == [""] * share + ["HTTP/1.1 503"] * (SCRAPE_HOLD - share)
            with trio.fail_after(2):  # well inside the 5 s a held slot could last
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(
                        f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                    assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(10)
        nursery.cancel_scope.cancel()


@pytest.fixture(params=[(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")],
                ids=["ipv4", "ipv6"])
def loopback_listener(request: pytest.FixtureRequest) -> Iterator[socket.socket]:
    """A listening stdlib socket on a free loopback port, once per address family."""
    family, host = request.param
    with socket.socket(family) as listener:
        try:
            listener.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} on this machine")
        listener.listen()
        yield listener


def test_peer_uid_is_the_client_sockets_owner(loopback_listener: socket.socket) -> None:
    """sock_diag names the owner of the client end of exactly this connection; a peer
    whose socket is gone is unknown (None), which the listener refuses."""
    with socket.create_connection(loopback_listener.getsockname()[:2]) as client:
        conn, _ = loopback_listener.accept()
        with conn:
            assert peer_uid(conn) == os.getuid()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            client.close()  # RST: the client's socket leaves the table at once
            time.sleep(0.05)
            assert peer_uid(conn) is None


def test_peer_uid_of_a_dual_stack_client_is_its_owner() -> None:
    """A client on an AF_INET6 socket with IPV6_V6ONLY off (the JVM's default, for one)
    reaches 127.0.0.1 as ::ffff:127.0.0.1; the kernel reports its socket v4-mapped. It is
    the same 4-tuple: its owner is named, not refused as unknown."""
    with socket.socket(socket.AF_INET) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:
            client = socket.socket(socket.AF_INET6)
        except OSError:
            pytest.skip("no IPv6 on this machine")
        with client:
            client.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            client.connect(("::ffff:127.0.0.1", listener.getsockname()[1]))
            conn, _ = listener.accept()
            with conn:
                assert peer_uid(conn) == os.getuid()


def test_peer_uid_of_a_client_that_already_closed_is_unknown(
        loopback_listener: socket.socket) -> None:
    """A client that closed (FIN, no RST) leaves a TIME-WAIT entry the kernel reports with
    uid 0 and no inode: that is no owner at all, not root."""
    client = socket.create_connection(loopback_listener.getsockname()[:2])
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    client.close()
    time.sleep(0.05)
    conn, _ = loopback_listener.accept()
    with conn:
        assert peer_uid(conn) is None


def _sock_diag(conn: socket.socket) -> tuple[bytes, bytes]:
    """The kernel's own answer to the lookup `peer_uid` makes for `conn`, and the sockid it
    asks for: what `tcp_peer._uid_from` reads, from the real socket table."""
    request = tcp_peer._request(conn.family, conn.getsockname()[:2], conn.getpeername()[:2])
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                       tcp_peer.NETLINK_SOCK_DIAG) as netlink:
        netlink.settimeout(tcp_peer.LOOKUP_TIMEOUT)
        netlink.sendto(request, (0, 0))
        answer = netlink.recv(8192)
    return answer, request[tcp_peer._NLMSGHDR.size + tcp_peer._REQ_HEAD.size:]


def test_an_answer_for_another_socket_names_no_uid(loopback_listener: socket.socket) -> None:
    """The kernel's answer is read only for the 4-tuple asked about: the answer for one
    connection, checked against another's socket id, names nobody."""
    address = loopback_listener.getsockname()[:2]
    with socket.create_connection(address) as _a, socket.create_connection(address) as _b:
        conn_a, _ = loopback_listener.accept()
        conn_b, _ = loopback_listener.accept()
        with conn_a, conn_b:
            answer_a, sockid_a = _sock_diag(conn_a)
            _, sockid_b = _sock_diag(conn_b)
            assert sockid_a != sockid_b
            assert tcp_peer._uid_from(answer_a, sockid_a, conn_a.family) == os.getuid()
            assert tcp_peer._uid_from(answer_a, sockid_b, conn_a.family) is None


def _own_address() -> str | None:
    """This machine's address on its default route (not loopback), or None. A UDP connect
    sends nothing; it only picks the source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737)
        except OSError:
            return None
        host: str = probe.getsockname()[0]
    return None if host.startswith("127.") or host == "0.0.0.0" else host


def test_peer_uid_of_a_peer_off_loopback_is_unknown() -> None:
    """Only a loopback peer is looked up. A client of this very machine that reaches us by
    another address has a socket the kernel would name (the control), and still has no
    uid: the listener refuses it."""
    host = _own_address()
    if host is None:
        pytest.skip("no address but loopback on this machine")
    with socket.socket(socket.AF_INET) as listener:
        listener.bind((host, 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()[:2]):
            conn, _ = listener.accept()
            with conn:
                answer, sockid = _sock_diag(conn)
                assert tcp_peer._uid_from(answer, sockid, conn.family) == os.getuid()
                assert peer_uid(conn) is None


async def test_status_says_which_rule_holds_the_port(tcp_host: Host) -> None:
    """`status` names what the running daemon serves on TCP and why; stopped, the rule."""
    from daemon.cli.status import _tcp

    config = load_config(str(tcp_host.daemon.log_path.with_name("broker.toml")), environ={})
    line = _tcp(config, tcp_host.state_dir, True).detail
    assert line.startswith(f"serving 127.0.0.1:{tcp_host.port} (unheld: the operator accepted"), line
    assert await tcp_host.daemon.stop() == 0
    assert not (tcp_host.state_dir / "serve.tcp").exists()
    line = _tcp(config, tcp_host.state_dir, False).detail
    assert line.startswith(f"127.0.0.1:{tcp_host.port}: held by systemd (socket activation) "
                           "if passed, else unheld"), line


def test_admission_by_uid_and_group() -> None:
    """tcp_allow_uids / tcp_allow_groups: a listed uid, or a member of a listed group
    (primary or supplementary, by name or gid); an unknown uid (None) never."""
    by_uid = TcpAdmission(frozenset({NOBODY}), frozenset())
    assert by_uid.admits(NOBODY) and not by_uid.admits(0) and not by_uid.admits(None)
    by_group = TcpAdmission(frozenset(), frozenset({"root"}))
    assert by_group.admits(0) and not by_group.admits(NOBODY) and not by_group.admits(None)
    by_gid = TcpAdmission(frozenset(), frozenset({str(NOBODY)}))  # nobody's primary group
    assert by_gid.admits(NOBODY) and not by_gid.admits(0)
    assert not TcpAdmission(frozenset(), frozenset({"no-such-group-here"})).admits(0)
    assert not by_group.admits(2**31 - 7)  # a uid without a user has no groups


class _StalledDirectory(TcpAdmission):
    """A user database (LDAP, sssd) that hangs on its first lookup until released: the
    scripted fault a local /etc/group cannot show."""

    def __init__(self, groups: frozenset[str], *, stalls: int) -> None:
        super().__init__(frozenset(), groups)
        object.__setattr__(self, "release", threading.Event())
        object.__setattr__(self, "calls", [0])
        object.__setattr__(self, "stalls", stalls)

    def admits(self, uid: int | None) -> bool:
        self.calls[0] += 1
        if self.calls[0] <= self.stalls:
            self.release.wait(30)
        return super().admits(uid)


def _tcp_request(port: int) -> bytes:
    return (f"POST /v1/action HTTP/1.1\r\nHost: localhost:{port}\r\n"
            "Content-Length: 2\r\n\r\n{}").encode()


async def _answer(port: int) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(_tcp_request(port))
        return await stream.receive_some(65536)


@needs_root
async def test_a_stalled_group_lookup_holds_up_only_its_own_uid() -> None:
    """With tcp_allow_groups, a lookup that hangs stalls its own uid's connections, not
    the listener: another uid's connection is accepted and answered meanwhile, and the
    first is answered once its lookup returns."""
    directory = _StalledDirectory(frozenset({"root", _group_of(NOBODY)}), stalls=1)
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, action_routes(_Echo()), tcp,
                                              HttpLimits(request_timeout=20),
                                              admit=AdmissionGate(directory, nursery=nursery, ttl=0, stale=0)))
        first: list[bytes] = []

        async def stalled() -> None:
            first.append(await _answer(port))

        nursery.start_soon(stalled)
        while directory.calls[0] < 1:
            await trio.sleep(0.01)
        with trio.fail_after(20):
            status, _, _ = await as_uid(NOBODY, port, _tcp_request(port))
        assert status == 200
        assert not first  # still waiting on its own lookup
        directory.release.set()
        with trio.fail_after(10):
            while not first:
                await trio.sleep(0.01)
        assert first[0].startswith(b"HTTP/1.1 200 ")
        nursery.cancel_scope.cancel()


def _group_of(uid: int) -> str:
    import grp
    import pwd

    return grp.getgrgid(pwd.getpwuid(uid).pw_gid).gr_name


async def test_one_uids_burst_of_connections_is_one_lookup() -> None:
    """Forty connections of one uid at once, its lookup slow: they wait for the one
    lookup under way instead of queueing forty on the lookup threads ahead of every other
    uid's (ttl 0, stale 0: no verdict is kept, only shared while it is asked)."""
    directory = _StalledDirectory(frozenset({"root"}), stalls=1)
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    answers: list[bytes] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, action_routes(_Echo()), tcp,
                                              HttpLimits(request_timeout=20),
                                              admit=AdmissionGate(directory, nursery=nursery, ttl=0, stale=0)))

        async def one() -> None:
            answers.append(await _answer(port))

        for _ in range(40):
            nursery.start_soon(one)
        await trio.sleep(0.5)
        assert directory.calls[0] == 1 and not answers
        directory.release.set()
        with trio.fail_after(10):
            while len(answers) < 40:
                await trio.sleep(0.01)
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        assert directory.calls[0] == 1, "the waiting connections took the one verdict"
        nursery.cancel_scope.cancel()


async def test_a_lookup_that_never_answers_admits_nobody() -> None:
    """A lookup still pending at request_timeout admits nobody (fail closed), and says so
    with a 503 naming the user database, not the refusal's 403: the same uid is admitted
    once a lookup answers, so a client retries it (the agent client never retries a 403
    naming a rule: tests/client/test_listener_refusal.py)."""
    directory = _StalledDirectory(frozenset({"root"}), stalls=1)
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve, action_routes(_Echo()), tcp,
                                                  HttpLimits(request_timeout=0.5),
                                                  admit=AdmissionGate(directory, nursery=nursery)))
            with trio.fail_after(10):
                refused = await _answer(port)
            assert refused.startswith(b"HTTP/1.1 503 ")
            assert refused.endswith(b"\r\n\r\n" + http.UNDECIDED_BODY)
            assert http.UNDECIDED_BODY not in {r.value for r in loopback_tcp.Refusal}
            nursery.cancel_scope.cancel()
    finally:
        directory.release.set()


async def test_a_connection_waiting_on_the_user_database_counts_in_its_uids_share() -> None:
    """A connection whose tcp_allow_groups lookup is pending is open and counted under its
    uid: past max_connections_per_uid, one more of that uid is 503 at once instead of
    taking another global slot to wait in. Else one local user, while the user database
    is slow, holds every connection slot of the listener and no agent is served."""
    directory = _StalledDirectory(frozenset({"root"}), stalls=3)
    tcp = bind_tcp_socket("127.0.0.1", 0)
    port = tcp.getsockname()[1]
    limits = HttpLimits(max_connections=4, max_connections_per_uid=2, request_timeout=60)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve, action_routes(_Echo()), tcp, limits,
                                                  admit=AdmissionGate(directory, nursery=nursery, ttl=0, stale=0)))
            waiting: list[bytes] = []

            async def stalled() -> None:
                waiting.append(await _answer(port))

            for _ in range(limits.max_connections_per_uid):
                nursery.start_soon(stalled)
            while directory.calls[0] < 1:
                await trio.sleep(0.01)
            await trio.sleep(0.3)  # the second waits on the uid's one lookup under way
            with trio.fail_after(10):  # on the old code it waited for its own lookup
                third = await _answer(port)
            assert third.startswith(b"HTTP/1.1 503 ") and third.endswith(b"\r\n\r\n")
            assert directory.calls[0] == 1  # the third was never looked up
            assert not waiting
            directory.release.set()
            with trio.fail_after(10):
                while len(waiting) < limits.max_connections_per_uid:
                    await trio.sleep(0.01)
            assert all(answer.startswith(b"HTTP/1.1 200 ") for answer in waiting)
            nursery.cancel_scope.cancel()
    finally:
        directory.release.set()


async def test_a_group_verdict_is_kept_for_its_ttl() -> None:
    """One lookup per uid per MEMBERSHIP_TTL: a fleet of one uid reconnecting does not ask
    the user database per connection; after the TTL the admission is asked again (in the
    background) and a group left counts from its answer."""
    directory = _Directory({0})
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        assert await gate(0) and await gate(0)
        assert directory.asked == [0]
        directory.members.clear()  # uid 0 leaves the group
        now[0] += MEMBERSHIP_TTL + 0.1
        with trio.fail_after(10):
            while await gate(0):  # served while its re-check is under way, refused after
                await trio.sleep(0.01)
        assert directory.asked == [0, 0], "one re-check, however many connections meanwhile"
        assert not await gate(None) and directory.asked == [0, 0]  # unknown: no lookup, refused


@contextlib.asynccontextmanager
async def _gate(directory: TcpAdmission, **options: Any) -> AsyncIterator[AdmissionGate]:
    """A gate whose background re-checks a nursery owns, cancelled when the test is done."""
    async with trio.open_nursery() as background:
        yield AdmissionGate(directory, nursery=background, **options)
        background.cancel_scope.cancel()


class _Directory(TcpAdmission):
    """A user database that answers for `members` at once and, with `hang_on_misses`, is
    slow to miss (LDAP, sssd asked for a uid it does not know) until released."""

    members: set[int]
    hang_on_misses: bool
    release: threading.Event
    #: every uid asked, in order
    asked: list[int | None]

    def __init__(self, members: set[int], *, hang_on_misses: bool = False) -> None:
        super().__init__(frozenset(), frozenset({"agents"}))
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "hang_on_misses", hang_on_misses)
        object.__setattr__(self, "release", threading.Event())
        object.__setattr__(self, "asked", [])

    def admits(self, uid: int | None) -> bool:
        self.asked.append(uid)
        if uid in self.members:
            return True
        if self.hang_on_misses:
            self.release.wait(30)
        return False


async def test_an_admitted_uids_recheck_does_not_wait_behind_other_uids_lookups() -> None:
    """One local user can own many uids (subordinate uids of rootless containers) that the
    directory is slow to miss, and their lookups hold every shared lookup thread. An
    admitted uid whose verdict is past its TTL is still admitted at once, and its re-check
    runs on a thread of its own meanwhile, not queued behind theirs."""
    directory = _Directory({0}, hang_on_misses=True)
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        try:
            assert await gate(0)
            now[0] += MEMBERSHIP_TTL + 0.1
            async with trio.open_nursery() as nursery:
                for uid in range(100000, 100040):
                    nursery.start_soon(gate, uid)
                with trio.fail_after(10):
                    while len(directory.asked) < 1 + loopback_tcp._LOOKUP_THREADS:
                        await trio.sleep(0.01)
                admitted: list[bool] = []

                async def reconnect() -> None:
                    admitted.append(await gate(0))

                nursery.start_soon(reconnect)
                await trio.testing.wait_all_tasks_blocked()
                assert admitted == [True], "uid 0 queued behind other uids' lookups"
                with trio.fail_after(10):
                    while directory.asked.count(0) < 2:
                        await trio.sleep(0.01)
                assert len(directory.asked) == 2 + loopback_tcp._LOOKUP_THREADS, \
                    "the re-check ran beside the stuck lookups, and no other lookup started"
                nursery.cancel_scope.cancel()
        finally:
            directory.release.set()


async def test_a_uid_removed_from_the_groups_is_refused_within_ttl_and_stale() -> None:
    """Fail closed: an admission is served past its TTL only while its re-check is pending,
    and never past MEMBERSHIP_TTL + MEMBERSHIP_STALE from when the database was asked. Then
    the uid's connection waits on a lookup like any uid without a verdict."""
    directory = _Directory({0}, hang_on_misses=True)
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        try:
            assert await gate(0)
            directory.members.clear()  # removed; the directory now hangs on it
            now[0] += MEMBERSHIP_TTL + MEMBERSHIP_STALE - 0.1
            assert await gate(0)  # still served; its re-check hangs
            with trio.fail_after(10):
                while directory.asked.count(0) < 2:
                    await trio.sleep(0.01)
            now[0] += 0.1  # the bound
            answered: list[bool] = []
            async with trio.open_nursery() as nursery:

                async def reconnect() -> None:
                    answered.append(await gate(0))

                nursery.start_soon(reconnect)
                await trio.testing.wait_all_tasks_blocked()
                assert answered == [], "past the bound it waits on a lookup, not admitted"
                directory.release.set()
            assert answered == [False]
            assert not await gate(0)
        finally:
            directory.release.set()


async def test_kept_verdicts_go_least_recently_used_first(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A full verdict table drops its least recently used uid, not its oldest inserted, and
    refused uids, however many, never push an admitted uid out (each verdict has its own
    table): an agent in use is not looked up again because strangers connected."""
    monkeypatch.setattr(loopback_tcp, "_MEMBERSHIP_ENTRIES", 2)
    directory = _Directory({1, 2, 3})
    async with _gate(directory, clock=lambda: 100.0) as gate:
        for uid in (1, 2, 1, 3):  # 1 used after 2: 2 goes when 3 comes
            assert await gate(uid)
        for uid in range(100000, 100010):
            assert not await gate(uid)
        asked = len(directory.asked)
        assert await gate(1) and await gate(3) and len(directory.asked) == asked
        assert await gate(2) and directory.asked[asked:] == [2]


def test_an_unreadable_port_range_makes_no_port_privileged(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """The shipped unit hides /proc/sys (ProcSubset=pid) and drops every capability: the
    daemon then binds a port below 1024 itself only where the range was lowered, that is
    where any user could have bound it first. Unread, the range is taken as starting at 0."""
    from daemon import loopback_tcp

    monkeypatch.setattr(loopback_tcp, "_SYSCTL", str(tmp_path / "hidden"))
    assert loopback_tcp.unprivileged_port_start() == 0
    assert port_holder_for(80) is None
    assert port_holder_for(80, held=True) == HELD_BY_SYSTEMD


def port_holder_for(port: int, *, held: bool = False) -> str | None:
    from daemon.loopback_tcp import port_holder

    return port_holder(port, held=held, accept_risk=False,
                       opt_in="listen_tcp_accept_squatting_risk")


@pytest.mark.parametrize("host", [b"0.0.0.0:8080", b"0.0.0.0", b"127.0.0.2:8080",
                                  b"[::ffff:127.0.0.1]:8080", b"localhost.:8080"])
def test_only_the_three_loopback_names_are_a_listeners_host(host: bytes) -> None:
    """`0.0.0.0` reaches loopback from a browser ("0.0.0.0 day"), and other spellings of
    loopback are no name an agent uses: none of them is the listener's Host."""
    assert loopback_tcp.browser_refusal([(b"host", host)], 8080) is loopback_tcp.Refusal.HOST
    assert loopback_tcp.browser_refusal([(b"host", host)], 80) is loopback_tcp.Refusal.HOST


def test_the_first_unprivileged_port_is_not_privileged(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """ip_unprivileged_port_start is the lowest port any user may bind: that port itself is
    squattable, the one below it is not."""
    sysctl = tmp_path / "ip_unprivileged_port_start"
    sysctl.write_text("1024\n")
    monkeypatch.setattr(loopback_tcp, "_SYSCTL", str(sysctl))
    assert port_holder_for(1024) is None
    assert port_holder_for(1023) == loopback_tcp.PRIVILEGED_PORT


async def test_a_refusal_is_kept_only_for_its_ttl() -> None:
    """A uid added to an allowed group is admitted within MEMBERSHIP_TTL: a refusal is
    never served stale (only an admission is, while its re-check is pending)."""
    directory = _Directory(set())
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        assert not await gate(0)
        directory.members.add(0)  # the operator adds the agent's user to the group
        now[0] += MEMBERSHIP_TTL - 0.1
        assert not await gate(0) and directory.asked == [0]  # still fresh: not asked again
        now[0] += 0.2
        assert await gate(0)
        assert directory.asked == [0, 0]


class _ScriptedDirectory(TcpAdmission):
    """Answers each lookup from `script` in order; a `None` entry blocks until `release`,
    then admits."""

    def __init__(self, script: list[bool | None]) -> None:
        super().__init__(frozenset(), frozenset({"agents"}))
        object.__setattr__(self, "script", list(script))
        object.__setattr__(self, "release", threading.Event())
        object.__setattr__(self, "calls", [0])

    def admits(self, uid: int | None) -> bool:
        step = self.script.pop(0)
        self.calls[0] += 1
        if step is None:
            self.release.wait(30)
            return True
        return step


async def test_a_late_recheck_answer_does_not_override_a_later_refusal() -> None:
    """A background re-check asked before a lookup but answering after it must not win:
    the later question's verdict (a refusal) stands."""
    directory = _ScriptedDirectory([True, None, False])
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        try:
            assert await gate(0)                       # asked at 100: admitted
            now[0] += MEMBERSHIP_TTL + 0.1
            assert await gate(0)                       # stale: served, re-check starts
            with trio.fail_after(10):
                while directory.calls[0] < 2:
                    await trio.sleep(0.01)
            now[0] += MEMBERSHIP_STALE                 # past the bound: a fresh lookup
            assert not await gate(0)                   # removed from the group
            directory.release.set()                    # the old re-check now says "member"
            with trio.fail_after(10):
                while gate._refreshing:
                    await trio.sleep(0.01)
            assert not await gate(0), "an answer to an older question replaced a newer one"
        finally:
            directory.release.set()


class _RaisingDirectory(TcpAdmission):
    """A user database whose second answer is an exception (a directory client's bug or
    an unexpected error type), not a refusal."""

    def __init__(self) -> None:
        super().__init__(frozenset(), frozenset({"agents"}))
        object.__setattr__(self, "calls", [0])

    def admits(self, uid: int | None) -> bool:
        self.calls[0] += 1
        if self.calls[0] == 2:
            raise RuntimeError("directory client fault")
        return True


async def test_a_recheck_that_raises_is_logged_and_ends_nothing() -> None:
    """A background re-check runs in the gate's nursery (the serving one): an exception
    there is recorded and the admission ages out; it must not end serving."""
    directory = _RaisingDirectory()
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        assert await gate(0)
        now[0] += MEMBERSHIP_TTL + 0.1
        assert await gate(0)  # stale: served, its re-check starts and raises
        with trio.fail_after(10):
            while directory.calls[0] < 2 or gate._refreshing:
                await trio.sleep(0.01)
        assert gate.recheck_faults.total == 1
        assert await gate(0)  # still served within its stale window (re-checked again)
        now[0] += MEMBERSHIP_STALE
        assert await gate(0) and directory.calls[0] >= 3  # and the gate goes on working


async def test_connections_waiting_on_a_uids_lookup_share_its_refusal() -> None:
    """A uid's connections that arrive while its lookup is under way wait for that lookup
    and get its verdict: a refused uid opening two connections at once is refused twice."""
    directory = _Directory(set(), hang_on_misses=True)
    async with _gate(directory, clock=lambda: 100.0) as gate:
        try:
            verdicts: list[bool] = []

            async def connect() -> None:
                verdicts.append(await gate(4242))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(connect)
                nursery.start_soon(connect)
                with trio.fail_after(10):
                    while not directory.asked:
                        await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
                directory.release.set()
            assert verdicts == [False, False]
            assert directory.asked == [4242], "one lookup for both connections"
        finally:
            directory.release.set()


async def test_an_admission_is_rechecked_every_ttl_not_only_once() -> None:
    """After its first background re-check, an admitted uid's verdict is re-checked again
    at its next TTL: a group left later still counts within MEMBERSHIP_TTL (plus the
    re-check's own time) while the database answers."""
    directory = _Directory({0})
    now = [100.0]
    async with _gate(directory, clock=lambda: now[0]) as gate:
        assert await gate(0)
        for rechecks in (1, 2):
            now[0] += MEMBERSHIP_TTL + 0.1
            assert await gate(0)
            with trio.fail_after(10):
                while directory.asked.count(0) < 1 + rechecks or gate._refreshing:
                    await trio.sleep(0.01)
        directory.members.clear()  # uid 0 leaves the group
        now[0] += MEMBERSHIP_TTL + 0.1
        with trio.fail_after(10):
            while await gate(0):  # served while its third re-check is under way
                await trio.sleep(0.01)
        assert directory.asked == [0, 0, 0, 0]


def test_a_failed_netlink_lookup_names_no_uid(loopback_listener: socket.socket,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails closed: where sock_diag cannot be asked (AF_NETLINK not allowed by the unit's
    RestrictAddressFamilies=, a seccomp filter, no memory), the peer's uid is unknown
    (None, refused), never a made-up one such as root's 0."""
    client = socket.create_connection(loopback_listener.getsockname()[:2])
    conn, _ = loopback_listener.accept()
    try:
        assert peer_uid(conn) == os.getuid()
        real = socket.socket

        def refused(family: int = -1, *args: Any, **kwargs: Any) -> socket.socket:
            if family == socket.AF_NETLINK:
                raise PermissionError(errno.EAFNOSUPPORT, "address family not allowed")
            return real(family, *args, **kwargs)

        monkeypatch.setattr(tcp_peer.socket, "socket", refused)
        assert peer_uid(conn) is None
    finally:
        monkeypatch.undo()
        conn.close()
        client.close()
