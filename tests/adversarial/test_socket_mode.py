"""A world-accessible socket is refused (issue 13, item 7).

Attack: `socket_mode = "0666"` (or any mode with an "other" bit) lets every local user —
every service account, every compromised process on the machine — connect to the daemon
and spend its memory and connection slots without a credential. The configuration loader
refuses such a mode with one line naming the key, so neither `serve` nor `check-config`
accepts it; modes that grant other users nothing still load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import ConfigError, load_config


def _config(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(f"[server]\nsocket_mode = {value}\n")
    return path


@pytest.mark.parametrize("value", ['"0666"', '"666"', '"0777"', '"0662"', '"0604"', '"0601"',
                                   "0o666", "0o007", "438"])
def test_world_accessible_socket_mode_is_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(str(_config(tmp_path, value)), environ={})
    message = str(refused.value)
    assert "socket_mode" in message and "world-accessible" in message and "\n" not in message


@pytest.mark.parametrize(("value", "mode"), [('"0660"', 0o660), ('"0600"', 0o600),
                                             ("0o770", 0o770), ('"0640"', 0o640)])
def test_owner_and_group_modes_still_load(tmp_path: Path, value: str, mode: int) -> None:
    config = load_config(str(_config(tmp_path, value)), environ={})
    assert config.server.socket_mode == mode and not config.server.socket_mode & 0o007
