"""The one loopback rule: which hosts count as this machine.

Rules:
- A host is loopback when it is a loopback IP literal (127.0.0.0/8, ::1) or a name in
  `LOOPBACK_NAMES`, compared without case. Those names mean this machine whatever the
  resolver is told (RFC 6761 §6.3). Other names (`ip6-localhost`,
  `localhost.localdomain`) are loopback only if /etc/hosts says so, which a check made
  on one machine cannot promise for the one the connection is made from: they are not.
- Pure: no resolver, no socket. The daemon's relay URL rule (`ws://` only to loopback,
  in the configuration check and the pool's constructor alike) and the agent client's
  plain-HTTP rule both call `is_loopback_host`; a connection to a loopback name is made
  to the pinned address, never to what a resolver answers.
"""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = ["LOOPBACK_NAMES", "is_loopback_host"]

#: Names that mean this machine (RFC 6761 §6.3), lowercase; with and without the root dot.
LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost."})


def is_loopback_host(host: str) -> bool:
    """True for a loopback IP literal or a name in `LOOPBACK_NAMES` (module docstring)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
