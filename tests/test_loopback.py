"""One loopback rule (issue 16): the configuration check, the relay pool and the agent
client's plain-HTTP rule decide every host the same way, because all three call
`buzzwire.loopback.is_loopback_host`. `ip6-localhost` once passed `check-config` and then
failed at start; here every decision is compared across the three, host by host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from buzz_broker_client._transport import Endpoint
from buzzwire.loopback import is_loopback_host
from daemon.config import ConfigError, load_config
from daemon.relay.protocol import check_relay_url

#: host (as written in a URL) -> loopback?
HOSTS = {
    "127.0.0.1": True,
    "127.8.9.10": True,
    "[::1]": True,
    "localhost": True,
    "LocalHost": True,
    "localhost.": True,
    "ip6-localhost": False,
    "localhost.localdomain": False,
    "localhost.evil.example": False,
    "10.0.0.1": False,
    "[::2]": False,
    "relay.example.com": False,
}


def _accepts(check: Callable[[], object]) -> bool:
    try:
        check()
    except (ValueError, ConfigError):
        return False
    return True


@pytest.mark.parametrize(("host", "loopback"), HOSTS.items())
def test_every_rule_decides_a_host_alike(tmp_path: Path, host: str, loopback: bool) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(f'[relay]\nurl = "ws://{host}:7777"\n', encoding="utf-8")
    assert is_loopback_host(host.strip("[]")) is loopback
    assert _accepts(lambda: load_config(str(config), environ={})) is loopback
    assert _accepts(lambda: check_relay_url(f"ws://{host}:7777")) is loopback
    assert _accepts(lambda: Endpoint.parse(f"http://{host}:7777")) is loopback


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost."])
def test_the_client_pins_a_loopback_name(host: str) -> None:
    # A name is never resolved: a hosts file mapping it elsewhere changes nothing.
    endpoint = Endpoint.parse(f"http://{host}:7777")
    assert (endpoint.kind, endpoint.host, endpoint.port) == ("tcp", "127.0.0.1", 7777)
