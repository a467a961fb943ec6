"""buzzwire: what the broker host and the agent-side client both know of the wire, pure.

- `buzzwire.contract`: agent-broker.md and NIP-BA as code: the strict JSON reader, the envelopes,
  the eighteen shapes, the limits, the status/code table. Bytes in, values or bytes out.
- `buzzwire.nostr`: public Nostr data: event values, the NIP-01 id, BIP-340 verification,
  the NIP-OA owner-tag check. Nothing here touches a secret.
- `buzzwire.threads`: which channel (`in_channel`) and which thread (`declared_thread`,
  `in_thread`) an event is in, from its signed tags: the one rule the broker's channel.read
  and message.reply and the contract's echo check all apply.

Rules: no I/O, no clock, no randomness, no logging; stdlib and coincurve only. The daemon,
custody and the agent-side client import it; it imports none of them, so an agent installs
it (its own distribution, `pip install ./buzzwire ./client`) without a PKCS#11 library.

The specifications, pinned (README.md, "The specifications, upstream"):
- agent-broker.md, on block/buzz#6790: https://github.com/block/buzz/blob/8b28ef0f0f2846ce3c063ecaa2c5e17254f7b87d/docs/agent-broker.md
- NIP-BA: https://github.com/block/buzz/blob/a7beb1988b668020967719c2a0552a95fead5416/docs/nips/NIP-BA.md
"""
