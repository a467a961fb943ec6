"""buzzwire: what the broker host and the agent-side client both know of the wire, pure.

- `buzzwire.contract`: spec/agent-broker.md as code: the strict JSON reader, the envelopes,
  the eighteen shapes, the limits, the status/code table. Bytes in, values or bytes out.
- `buzzwire.nostr`: public Nostr data: event values, the NIP-01 id, BIP-340 verification,
  the NIP-OA owner-tag check. Nothing here touches a secret.

Rules: no I/O, no clock, no randomness, no logging; stdlib and coincurve only. The daemon,
custody and the agent-side client import it; it imports none of them, so an agent can
install it (with the client) without the daemon's runtime or a PKCS#11 library.
"""
