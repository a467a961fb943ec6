// NIP-46 remote signer ("bunker") for benchmarks/bunker.py: NDK's NDKNip46Backend holding one
// fresh key, listening on one relay, allowing every request (the benchmark measures the round
// trip, not a permission policy). Prints {"bunker": "bunker://<pubkey>?relay=<url>"} once
// subscribed; runs until killed. The key is generated here and never leaves this process.
//
//   NIP46_MODULES=<dir> node bunker.mjs <relay-url> [--auth]
import { authenticated, emit, fail, ndkModule, ndkOptions } from "./_ndk.mjs";

const { default: NDK, NDKNip46Backend, NDKPrivateKeySigner, NDKRelayAuthPolicies } = ndkModule;
const [url, flag] = process.argv.slice(2);
if (!url?.startsWith("ws://127.0.0.1:")) fail("usage: bunker.mjs ws://127.0.0.1:PORT [--auth]");

const key = NDKPrivateKeySigner.generate();
const ndk = new NDK(ndkOptions(url, { signer: key }));
if (flag === "--auth") ndk.relayAuthDefaultPolicy = NDKRelayAuthPolicies.signIn({ ndk, signer: key });
await ndk.connect(10_000);
const backend = new NDKNip46Backend(ndk, key, async () => true, [url]);
// switch_relays (NDK's client sends it right after connect) is declined: answering it makes
// NDK 3.0.3's backend drop its RPC connection and open a new one, unauthenticated, on which
// the next response is refused with "auth-required" and never re-sent. Declining is allowed
// (the method is optional; the client then keeps its relays) and changes no relay here.
backend.setStrategy("switch_relays", { handle: async () => undefined });
await backend.start();
const user = await key.user();
if (flag === "--auth") await authenticateRpc(backend);
emit({ bunker: `bunker://${user.pubkey}?relay=${encodeURIComponent(url)}`, pubkey: user.pubkey });

// The backend answers through its own connection (its RPC pool), which NDK opens but does
// not authenticate until the relay asks; LocalRelay asks on the first restricted message.
// So before announcing itself the bunker sends one response to a throwaway key on that
// connection, which makes the relay ask, and waits until NDK's AUTH has gone through.
async function authenticateRpc(backend) {
  const nobody = (await NDKPrivateKeySigner.generate().user()).pubkey;
  await authenticated(backend.rpc.relaySet.relays, async () => {
    backend.rpc.sendResponse("prime", nobody, "prime").catch(() => {});
  }, "the bunker's RPC connection");
}
