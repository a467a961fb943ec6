// Loads NDK and a WebSocket for node from the directory benchmarks/bunker.py installed them
// into (NIP46_MODULES, a temporary directory): the repository holds no node_modules, and ESM
// resolves bare names from the script's own directory, so the packages are loaded through a
// require() rooted there (their CommonJS builds; NDK's default export is `.default`).
import { createRequire } from "node:module";
import { join } from "node:path";

const modules = process.env.NIP46_MODULES;
if (!modules) {
  console.error("NIP46_MODULES is not set (benchmarks/bunker.py sets it)");
  process.exit(2);
}
const require = createRequire(join(modules, "package.json"));

// Loopback only: NDK would otherwise dial its default outbox relays on the internet. The
// NDK options below switch that off; this guard makes any other dial fail loudly.
const LOOPBACK = /^(wss?|https?):\/\/127\.0\.0\.1:\d+(\/|$)/;
function loopbackOnly(url) {
  if (!LOOPBACK.test(String(url))) throw new Error(`refused a non-loopback address: ${url}`);
}
// node 20 has no global WebSocket; NDK opens relays with `new WebSocket(url)`.
const WS = require("ws");
globalThis.WebSocket = class extends WS {
  constructor(url, ...rest) {
    loopbackOnly(url);
    super(url, ...rest);
  }
};
const realFetch = globalThis.fetch;
globalThis.fetch = (url, ...rest) => {
  loopbackOnly(url instanceof Request ? url.url : url);
  return realFetch(url, ...rest);
};
export const ndkModule = require("@nostr-dev-kit/ndk");

// NDK options for a loopback-only benchmark: the one relay, no outbox model, no user relays.
export function ndkOptions(relay, extra = {}) {
  return {
    explicitRelayUrls: [relay],
    enableOutboxModel: false,
    autoConnectUserRelays: false,
    relayConnectionFilter: (url) => LOOPBACK.test(url),
    ...extra,
  };
}

// One line of JSON per message on stdout: the Python side reads them.
export function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

export function fail(message) {
  emit({ error: message });
  process.exit(1);
}

// Resolves once every relay in `relays` has completed NIP-42 AUTH after `trigger()` sent it a
// restricted message (LocalRelay challenges only then); fails the process after `ms`.
// Needed because NDK 3.0.3 does not re-send an EVENT the relay refused with "auth-required"
// (seen here: the first publish on a fresh connection is lost), so every connection that
// will publish is authenticated before anything is timed.
export async function authenticated(relays, trigger, what, ms = 10_000) {
  const authed = Promise.all([...relays].map((relay) => new Promise((resolve) => relay.once("authed", resolve))));
  await trigger();
  let timer;
  const limit = new Promise((resolve) => { timer = setTimeout(resolve, ms, "timeout"); });
  const outcome = await Promise.race([authed, limit]);
  clearTimeout(timer);
  if (outcome === "timeout") fail(`${what} did not authenticate to the relay within ${ms} ms`);
}
