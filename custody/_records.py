"""Custody's public values: what it tells the pipeline about a key, where a memory note
lives, and how many unsealed keys it may cache. No secret, and nothing here imports code
that handles one, so the pipeline's client of the custodian (custody/custodian/client.py)
holds these without loading the curve, the secret buffers or NIP-44, and a process with the
cache off (the default) never loads the cache itself (custody/_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_RECORDS", "MAX_CACHE_ENTRIES", "MAX_CACHE_SECONDS", "MAX_KEK_LABEL",
           "MAX_RECORDS", "MAX_UID", "OWNER_TAG_CONDITIONS", "CachePolicy", "KeyRecord",
           "MemoryAddress", "RecordBound", "kek_label_ok"]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """Custody's public facts about one agent key. `deleted_at` is set on a tombstone (the
    key is destroyed). No secret, and nothing custody does not need (no name, no depth)."""

    pubkey: str
    owner: str
    auth_tag: tuple[str, str, str, str] | None
    created_at: int
    deleted_at: int | None
    mint_ref: str | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None


#: Buzz signs NIP-OA tags with empty conditions (buzz-on-the-relay.md); custody makes and
#: takes no others (custody/_signer.py), so a record's tag is fixed in size.
OWNER_TAG_CONDITIONS = ""
#: Key records, destroyed ones included, past which a mint or an import is refused unless
#: configured otherwise: the daemon's `[custody] max_records` and the custodian's
#: `[custodian] max_records` both default to this one number.
DEFAULT_MAX_RECORDS = 5_000
#: Key records a keystore may hold at most, whatever the configuration: that many of the
#: largest (a 512-character mint_ref JSON writes 6-fold, a tombstone, a NIP-OA tag) fit the
#: custodian's `agents` answer, one frame, and a few more would not (custody/custodian/
#: messages.py re-exports it; tests/custodian/test_log_and_rate_bounds.py
#: ::test_at_most_max_records_the_largest_records_fit_the_agents_answer builds that frame).
MAX_RECORDS = 7_161


@dataclass(frozen=True, slots=True)
class RecordBound:
    """Key records held at most, destroyed ones (tombstones) included, before a mint or an
    import is refused (`Custody.room`), and the refusal's way out for the operator. The
    configurations keep `most` within 1 to `MAX_RECORDS` (custody/custodian/messages.py)."""

    most: int = DEFAULT_MAX_RECORDS
    #: what to do, as the refusal says it: the configuration key to raise, a command
    remedy: str = "raise max_records"

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError("a record bound allows at least one record")


@dataclass(frozen=True, slots=True)
class MemoryAddress:
    """Where an agent's memory note lives on the relay. Public."""

    author_pubkey: str
    kind: int
    d_tag: str


#: Bounds the configuration accepts: 64 Ki keys (2 MiB locked), an hour.
MAX_CACHE_ENTRIES = 65536
MAX_CACHE_SECONDS = 3600.0
#: The largest uid (or gid) a configuration may name: (uid_t) -1 means "no uid" to the
#: kernel, and chown(2) reads (gid_t) -1 as "leave the group unchanged". The custodian's
#: `pipeline_uid` and the daemon's uids and gids alike (daemon/config.py).
MAX_UID = 2**32 - 2
#: A KEK label is written into every blob with a one-byte length (custody/_sealed.py); the
#: daemon's and the custodian's configurations refuse any other at load.
MAX_KEK_LABEL = 255


def kek_label_ok(label: str) -> bool:
    """Whether `label` can name a KEK in a blob: 1..MAX_KEK_LABEL printable ASCII."""
    return 0 < len(label) <= MAX_KEK_LABEL and all(0x20 <= ord(c) <= 0x7E for c in label)


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How many unsealed keys may be held, and for how long after their unseal."""

    entries: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.entries <= MAX_CACHE_ENTRIES:
            raise ValueError(f"cache entries must be 0..{MAX_CACHE_ENTRIES}")
        if self.entries and not 0 < self.seconds <= MAX_CACHE_SECONDS:
            raise ValueError(f"cache seconds must be in (0, {MAX_CACHE_SECONDS:g}]")
