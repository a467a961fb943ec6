"""The AUTH gate: one request at a time on a connection until the relay needs no AUTH.

Rules:
- Two `AuthGate`s per relay connection (`daemon.relay.pool._Connection`): one for EVENTs,
  one for REQs, since a relay may ask for AUTH to write and not to read (or the reverse).
  Each starts closed. While closed, one request (the probe) may go to the relay; every
  other request of its kind waits in `passage`. The connection's dispatch calls `open`
  on the first answer to a request of the gate's kind that is not ``auth-required:``
  (an OK to an EVENT we sent; an EOSE or a CLOSED of a REQ of ours), and on both gates
  for the OK true to our AUTH; from then on `passage` costs one attribute test. It never
  closes again.
- A probe that ends without the gate opening (its AUTH refused or unanswered, a timeout,
  a cancellation) hands the gate to the next waiter, which probes in turn.
- `shut` (the connection died) lets every waiter through at once: the caller sees the
  dead connection and answers as it does for one (NotSent / RelayUnavailable).
- No I/O, no clock but the caller's bound, no logging: the pool owns all of that.

Why (NIP-42, measured against nostr-sdk's LocalRelay, tests/relay/test_auth_burst.py): a
relay that challenges only after refusing something sends a new challenge with every
refusal, and LocalRelay forgets every challenge once more than 20 are outstanding. A
burst of 60 requests on a fresh connection drew 60 refusals, and the AUTH answering the
first challenge arrived after the relay had forgotten it ("auth-required: received invalid
challenge"): the publish failed, the query was refused. With one request in flight the
relay issues one challenge, and it is the one we answer. One gate for both kinds let a
read's EOSE release a burst of EVENTs on a relay that guards writes only, with the same
result (tests/relay/test_auth_later.py, and test_auth_burst.py against LocalRelay's
write-only mode).

Alternatives rejected: answering the newest challenge (still races the refusals the relay
has not sent yet; LocalRelay's count is per connection, not per request); AUTH before
every first send (a relay that challenges only after a refusal gives nothing to answer).

WARNING: every way a connection ends must call `shut` (`_Connection.mark_dead` does);
a waiter would otherwise sit out its whole timeout behind a probe that will never end.
"""

from __future__ import annotations

import trio

__all__ = ["AuthGate"]


class AuthGate:
    """Closed until `open`; while closed, `passage` admits one probe at a time."""

    __slots__ = ("is_open", "_shut", "_probing", "_changed")

    def __init__(self) -> None:
        #: The relay answered something without ``auth-required:``: everyone may send.
        self.is_open = False
        self._shut = False
        self._probing = False
        #: Set (and replaced) whenever a waiter may have become able to go.
        self._changed = trio.Event()

    def open(self) -> None:
        """The relay answered without ``auth-required:``; let everyone through."""
        if not self.is_open:
            self.is_open = True
            self._wake()

    def shut(self) -> None:
        """The connection is dead: let every waiter through to see it."""
        self._shut = True
        self._wake()

    def passage(self, seconds: float) -> _Passage:
        """``async with gate.passage(seconds) as through``: wait up to `seconds` to be let
        through; `through` is True if let through, False if not.

        The block runs either way (a False caller answers with its own timeout result).
        A caller let through while the gate is closed is the probe until its block ends.

        Cancellation: a waiter cancelled while waiting leaves nothing behind; a probe
        cancelled in its block hands the gate to the next waiter (``__aexit__``).
        """
        return _Passage(self, seconds)

    async def _wait_turn(self) -> bool:
        """Until the gate opens (False) or this caller becomes the probe (True)."""
        while not (self.is_open or self._shut):
            if not self._probing:
                # No checkpoint between claiming and returning: a cancellation cannot
                # land between them and leave a probe nobody releases.
                self._probing = True
                return True
            await self._changed.wait()
        return False

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _release(self) -> None:
        self._probing = False
        self._wake()


class _Passage:
    """One caller's way through an `AuthGate` (`AuthGate.passage`).

    A class, not an ``asynccontextmanager``: every warm request takes this path, and on an
    open gate it is two attribute tests. Measured (benchmarks/relay_connections.py,
    ``gate_open_passage``): 1.2 us a request, 4.2 us in the generator form; a warm
    EVENT -> OK round trip on loopback is 500-800 us.
    """

    __slots__ = ("_gate", "_seconds", "_probe")

    def __init__(self, gate: AuthGate, seconds: float) -> None:
        self._gate, self._seconds, self._probe = gate, seconds, False

    async def __aenter__(self) -> bool:
        gate = self._gate
        if gate.is_open or gate._shut:
            return True
        with trio.move_on_after(self._seconds):
            self._probe = await gate._wait_turn()
        return self._probe or gate.is_open or gate._shut

    async def __aexit__(self, *exc: object) -> None:
        if self._probe:
            self._probe = False
            self._gate._release()
