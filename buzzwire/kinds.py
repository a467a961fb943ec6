"""Every Nostr event kind this project signs, reads or checks: the one table of them.

The contract (`ActionSpec.published_kind`), the operations that build the events, the relay
reader, the read windows and the custodian's list of what it signs all name kinds from
here, so a kind is written once. Plain ints, not an enum: they go into NIP-01's
serialization and the strict JSON writers as they are.
"""

from __future__ import annotations

from typing import Final

METADATA: Final = 0            # NIP-01 profile (profile.set, agents.create/update)
DELETION: Final = 5            # NIP-09 (agents.delete; a deletion a read window obeys)
REACTION: Final = 7            # NIP-25 (reaction.add)
STREAM_MESSAGE: Final = 9      # Buzz's channel message (message.post, message.reply)
PUT_USER: Final = 9000         # NIP-29 add a member (agents.create's channel membership)
PUT_USER_ROLE: Final = "bot"   # the one role a 9000 gives (buzz-on-the-relay.md)
REMOVE_USER: Final = 9001      # NIP-29 remove a member (ends a read window)
DELETE_EVENT: Final = 9005     # NIP-29 moderator deletion (a deletion a read window obeys)
PRESENCE: Final = 20001        # NIP-BA live signal (presence.set)
TYPING: Final = 20002          # NIP-BA live signal (typing.set)
AUTH: Final = 22242            # NIP-42 relay authentication
OBSERVER_FRAME: Final = 24200  # NIP-AO telemetry (observer.emit)
MEMORY: Final = 30174          # NIP-AE agent memory (storage.put, storage.get)
MANAGED_AGENT: Final = 30177   # Buzz's managed-agent record (agents.create/update/delete)
STREAM_MESSAGE_V2: Final = 40002  # Buzz's channel message, second form (read only)

#: NIP-01: a kind is an integer in 0..65535.
MAX: Final = 65535
