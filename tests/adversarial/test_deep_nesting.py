"""Every reader of JSON that comes from outside refuses nesting past the interpreter's depth.

The stdlib's json raises RecursionError (not ValueError) for a document nested deeper than
it goes; a reader catching only ValueError let it out as a traceback. Found in two
readers (a relay event's profile content, a NIP-OA tag given on the command line) and in
the backup reader (tests/backup/test_backup_fuzz.py). The table names each reader that
faces an agent, the relay, an operator or another process, and what refusal it gives.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from buzzwire.contract import _json as strict_json
from custody.custodian import messages
from daemon.cli._common import CliError
from daemon.cli.agent_auth import parse_tag
from daemon.operations._events import json_object_or_none
from daemon.operations._memory import read_body
from daemon.operations.observer_emit import is_json_text
from daemon.relay.protocol import RelayProtocolError, parse_relay_message

DEEP = "[" * 100_000 + "]" * 100_000


def _refused(call: Callable[[], object], error: type[BaseException]) -> Callable[[], bool]:
    def check() -> bool:
        with pytest.raises(error):
            call()
        return True
    return check


#: reader -> a check that it refuses DEEP its own way (True when it did)
READERS: dict[str, Callable[[], bool]] = {
    "agent request body (strict reader)": _refused(lambda: strict_json.parse(DEEP.encode()),
                                                   strict_json.JsonSyntaxError),
    "relay frame": _refused(lambda: parse_relay_message(DEEP), RelayProtocolError),
    "relay event content (profile, managed record)": lambda: json_object_or_none(DEEP) is None,
    "memory body (NIP-AE plaintext)": lambda: read_body(
        ('{"slug":"mem/a","value":' + DEEP + "}").encode(), "mem/a") is None,
    "observer payload": lambda: is_json_text(DEEP) is False,
    "custodian message": _refused(lambda: messages.decode_request(DEEP.encode()),
                                  messages.BadMessage),
    "NIP-OA tag on the command line": _refused(lambda: parse_tag(DEEP, "--tag"), CliError),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_deep_nesting_is_refused_not_raised(reader: str) -> None:
    assert READERS[reader]()
