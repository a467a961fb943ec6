"""observer.emit: each frame becomes a NIP-AO telemetry event, encrypted to the owner, queued.

On the relay (NIP-AO "Event Structure"): kind 24200 signed by the agent, tags
`["p", owner]`, `["agent", agent]`, `["frame", "telemetry"]` (and the agent's NIP-OA `auth`
tag, which custody adds to every event it signs), content = NIP-44 v2 ciphertext to the
owner of the frame's `ObserverEvent`, which the host builds (NIP-AO "Decrypted Payload"):

    {"seq":N,"timestamp":"2026-12-01T21:00:41.500Z","kind":<frame kind>,
     "channelId":<the session's channel or null>,"payload":<the frame's payload>}

- `seq`: daemon/state/observer_seq.py, monotonic per agent across requests and restarts.
- `timestamp`: RFC 3339 UTC with milliseconds, one reading of the clock per request.
- `channelId`: the credential's channel when it is bound to exactly one; null otherwise
  (NIP-AO allows null: a credential over several channels names no one session channel).
- `payload`: the frame's payload spliced in byte for byte when it is one JSON text
  (RFC 8259: what the stdlib reader accepts, less NaN and the infinities); otherwise it is
  carried as a JSON string holding it exactly (NIP-BA calls the payload an opaque string;
  NIP-AO wants JSON there, and a string is the one JSON value that keeps every byte).
  The host never reads a payload for meaning (NIP-BA: not routing, not authority).

Steps, and what each costs: one `take` of seq numbers (a commit per 4,096 frames); each
frame's event size worked out before anything is encrypted (`_frame_bytes`: NIP-44 v2's
payload length is fixed by the plaintext's, and everything else in the event is known),
and that room `reserve`d in the queue (daemon/pipeline/observer.py) under this request's
own hold key (the broker's ledger ticket, `ObserverIntake.hold_key`); one custody hop that
encrypts only the frames reserved, under one unseal; one signing hop for them; then the
queue's `hold`, which admits them into the room reserved. So custody encrypts and signs no
frame the queue would turn away: a credential whose share is nearly full buys as many
signatures as it has room, not 256 (tests/e2e/test_observer.py
`test_a_nearly_full_share_signs_only_what_it_admits`), and what observer.emit costs
custody over time is bounded by what the pacer drains (`publish_per_second`).
`accepted` counts the admitted events, which is a count, not which frames (NIP-BA). A
frame whose ObserverEvent exceeds `MAX_WRAPPED_BYTES` is not encrypted and not counted;
neither is one the queue has no room for. When the share is already full nothing is
unsealed: `accepted` is 0.

The plaintexts are secrets (an observer payload): they exist only in this function's
locals and custody's call, are never logged, and never reach the ledger (the stored
verdict is the count) or the queue (which holds ciphertext).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Final

from buzzwire.contract import ObserverEmitArgs, ObserverEmitOutcome, Verdict
from buzzwire.nostr import SignedEvent
from daemon.operations._base import Context
from daemon.operations._events import sign_all
from daemon.pipeline.observer import KIND_OBSERVER_FRAME, frame_bytes

__all__ = ["prepare", "observer_event", "is_json_text", "nip44_payload_chars",
           "MAX_WRAPPED_BYTES", "ACTION"]

ACTION: Final = "observer.emit"
#: The largest ObserverEvent this host encrypts, in UTF-8 bytes: NIP-44 v2's plaintext cap,
#: which NIP-AO repeats ("Decrypted payload MUST NOT exceed 65,535 bytes"). rust-nostr
#: (Buzz's SDK) will not *write* above 65,408 but reads up to 65,535, so an owner's client
#: opens every frame this host sends (tests/e2e/test_observer.py decrypts one of 65,535
#: bytes with nostr-sdk). A frame whose ObserverEvent is larger is not counted.
MAX_WRAPPED_BYTES: Final = 65_535


class _NotJson(Exception):
    pass


def _no_constant(_name: str) -> object:
    raise _NotJson


def is_json_text(text: str) -> bool:
    """True when `text` is one RFC 8259 JSON text (surrounding whitespace allowed)."""
    try:
        # parse_int: an integer of any length is JSON; `int()` refuses past 4,300 digits.
        json.loads(text, parse_constant=_no_constant, parse_int=lambda _digits: None)
    except (ValueError, _NotJson, RecursionError):
        # RecursionError: nesting deeper than the stdlib reader goes. Carried as a string
        # then, like any payload this host cannot vouch for.
        return False
    return True


def observer_event(*, seq: int, timestamp: str, kind: str, payload: str,
                   channel_id: str | None) -> str:
    """The ObserverEvent plaintext of one frame (module docstring)."""
    head = json.dumps({"seq": seq, "timestamp": timestamp, "kind": kind,
                       "channelId": channel_id}, ensure_ascii=False, separators=(",", ":"))
    body = payload if is_json_text(payload) else json.dumps(payload, ensure_ascii=False)
    return f'{head[:-1]},"payload":{body}}}'


def nip44_payload_chars(plaintext_bytes: int) -> int:
    """Characters of the NIP-44 v2 payload of a plaintext this long (1..65,535 bytes):
    base64 of version (1) + nonce (32) + length prefix (2) + padded plaintext + MAC (32).
    NIP-44's padding: 32 at least, then steps of 32 up to 256 bytes, and of an eighth of
    the next power of two above (custody/_nip44.py `padded_length`; the two are held
    equal by tests/e2e/test_observer.py)."""
    if plaintext_bytes <= 32:
        padded = 32
    else:
        next_power = 1 << (plaintext_bytes - 1).bit_length()
        chunk = 32 if next_power <= 256 else next_power // 8
        padded = chunk * ((plaintext_bytes - 1) // chunk + 1)
    raw = 1 + 32 + 2 + padded + 32
    return 4 * ((raw + 2) // 3)


def _frame_bytes(template: SignedEvent, plaintext_bytes: int) -> int:
    """The `frame_bytes` of the event a plaintext this long becomes: `template` (this
    request's event with empty content) plus its payload, which is base64 and so needs no
    JSON escaping."""
    return frame_bytes(template) + nip44_payload_chars(plaintext_bytes)


def rfc3339_millis(seconds: float) -> str:
    """`2026-12-01T21:00:41.500Z`: NIP-AO's timestamp, UTC with sub-second precision."""
    moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


async def prepare(ctx: Context, args: ObserverEmitArgs) -> Verdict:
    intake = ctx.observer
    assert intake is not None, "the daemon wires an observer intake"  # daemon/wiring.py
    agent = ctx.principal.agent
    credential = ctx.principal.credential_id
    if intake.queue.room(credential) == 0:
        # The share is full: no frame could be admitted, so nothing is unsealed or signed.
        return Verdict.succeeded(ACTION, ObserverEmitOutcome(accepted=0))
    record = ctx.custody.agent(agent)
    assert record is not None, "authentication checked the agent is live"
    seqs = await intake.seq.take(agent, len(args.frames))
    stamp = rfc3339_millis(intake.clock())
    channel = next(iter(ctx.principal.channels)) if len(ctx.principal.channels) == 1 else None
    plaintexts = [
        observer_event(seq=seq, timestamp=stamp, kind=frame.kind, payload=frame.payload,
                       channel_id=channel).encode("utf-8")
        for seq, frame in zip(seqs, args.frames)
    ]
    tags = (("p", record.owner), ("agent", agent), ("frame", "telemetry"))
    now = ctx.now()
    # The event each frame becomes, but for its content: custody adds the agent's NIP-OA
    # `auth` tag to every event it signs (custody/_signer.py `with_owner_tag`), id and sig
    # are 64 and 128 hex characters.
    auth_tag = record.auth_tag
    template = SignedEvent(id="0" * 64, pubkey=agent, created_at=now, kind=KIND_OBSERVER_FRAME,
                           tags=tags if auth_tag is None else (*tags, auth_tag),
                           content="", sig="0" * 128)
    sizes = [_frame_bytes(template, len(p)) if len(p) <= MAX_WRAPPED_BYTES else None
             for p in plaintexts]
    assert intake.hold_key is not None, "the broker names this request's hold key"
    # Room first: only the frames the queue set room aside for are encrypted and signed.
    fits = intake.queue.reserve(intake.hold_key, credential, sizes)
    if not any(fits):
        return Verdict.succeeded(ACTION, ObserverEmitOutcome(accepted=0))
    ciphertexts = iter(await ctx.custody.encrypt_to_owner(
        agent, tuple(p for p, ok in zip(plaintexts, fits) if ok)))
    del plaintexts
    signed = iter(await sign_all(ctx, [(agent, KIND_OBSERVER_FRAME, tags, next(ciphertexts), now)
                                       for _ in range(sum(fits))]))
    events: list[SignedEvent | None] = [next(signed) if ok else None for ok in fits]
    admitted = intake.queue.hold(intake.hold_key, credential, agent, events)
    return Verdict.succeeded(ACTION, ObserverEmitOutcome(accepted=sum(admitted)))
