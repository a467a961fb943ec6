"""A socket path longer than sockaddr_un holds (107 bytes and its NUL) is refused by the
configuration itself, so `check-config` says so as `serve` does, rather than answer ok for
a file `serve` then refuses (daemon/config.py; `serve`'s own bind check is daemon/http.py
`MAX_SOCKET_PATH_BYTES`). Each socket key: the daemon's, the metrics socket, the
custodian's (connect() takes no longer a path than bind()).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from custody import TokenConfig
from tests.fixtures.broker import write_config

REPO = Path(__file__).resolve().parents[2]
KEYS = [("server", "socket"), ("metrics", "socket"), ("custody", "custodian_socket")]


def _check_config(token: TokenConfig, tmp_path: Path, section: str, key: str,
                  socket: Path) -> subprocess.CompletedProcess[str]:
    config = write_config(tmp_path / "broker.toml", token=token, state_dir=tmp_path / "state",
                          socket=tmp_path / "b.sock", relay_url="ws://127.0.0.1:1",
                          sections={section: {key: str(socket)}})
    env = {k: v for k, v in os.environ.items() if k != "BUZZ_BROKER_CONFIG"}
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--config", str(config),
                           "check-config"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("section, key", KEYS)
def test_a_socket_path_longer_than_107_bytes_is_refused_by_check_config(
        token_config: TokenConfig, tmp_path: Path, section: str, key: str) -> None:
    socket = tmp_path / ("s" * 120 + ".sock")
    done = _check_config(token_config, tmp_path, section, key, socket)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"[{section}] {key}:" in lines[0] and "at most 107 bytes" in lines[0], lines[0]


@pytest.mark.parametrize("section, key", KEYS)
def test_a_socket_path_of_107_bytes_is_accepted(
        token_config: TokenConfig, tmp_path: Path, section: str, key: str) -> None:
    socket = tmp_path / "s"
    socket = tmp_path / ("s" * (107 - len(os.fsencode(socket)) + 1))
    assert len(os.fsencode(socket)) == 107
    done = _check_config(token_config, tmp_path, section, key, socket)
    assert done.returncode == 0, done.stderr
