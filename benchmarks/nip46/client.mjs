// NIP-46 client for benchmarks/bunker.py: NDK's NDKNip46Signer connects once to the bunker,
// then asks it to sign N kind-9 channel messages one after another and times each request
// until the signed event is back. With --publish each signed event is also published and the
// relay's OK awaited (sign + publish: what a broker message.post does). Warm-up requests are
// not timed. Prints one JSON line: {"latencies_ms": [...], "failures": n, "cpu_ms": x}.
//
//   NIP46_MODULES=<dir> node client.mjs <bunker-uri> <channel> <n> <warmup> <timeout-ms> [--auth] [--publish]
import { authenticated, emit, fail, ndkModule, ndkOptions } from "./_ndk.mjs";

const { default: NDK, NDKEvent, NDKNip46Signer, NDKPrivateKeySigner, NDKRelayAuthPolicies } = ndkModule;
const [uri, channel, nText, warmText, timeoutText, ...flags] = process.argv.slice(2);
const n = Number(nText), warmup = Number(warmText), timeoutMs = Number(timeoutText);
if (!uri?.startsWith("bunker://") || !(n > 0) || !(warmup >= 0) || !(timeoutMs > 0)) {
  fail("usage: client.mjs bunker://... CHANNEL N WARMUP TIMEOUT_MS [--auth] [--publish]");
}
const relay = decodeURIComponent(new URL(uri).searchParams.get("relay"));
const publish = flags.includes("--publish");

// The client's own key: it encrypts the requests and (with --auth) answers the relay's AUTH.
const local = NDKPrivateKeySigner.generate();
const ndk = new NDK(ndkOptions(relay));
if (flags.includes("--auth")) ndk.relayAuthDefaultPolicy = NDKRelayAuthPolicies.signIn({ ndk, signer: local });
await ndk.connect(10_000);
const signer = NDKNip46Signer.bunker(ndk, uri, local);

// Every await is bounded: a lost reply fails the run instead of hanging it.
function bounded(promise, what) {
  let timer;
  const limit = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} took over ${timeoutMs} ms`)), timeoutMs);
  });
  return Promise.race([promise, limit]).finally(() => clearTimeout(timer));
}

try {
  await bounded(signer.blockUntilReady(), "connect");
} catch (e) {
  fail(`connect to the bunker: ${e.message ?? e}`);
}
ndk.signer = signer;
if (publish && flags.includes("--auth")) {
  // The connection that publishes the signed events has sent nothing yet: one REQ makes the
  // relay challenge it (see authenticated() in _ndk.mjs).
  await authenticated(ndk.pool.relays.values(), async () => {
    ndk.subscribe({ kinds: [9], limit: 1 }, { closeOnEose: true });
  }, "the client's publishing connection");
}

async function once(i) {
  const event = new NDKEvent(ndk, {
    kind: 9, content: `bunker ${i}`, tags: [["h", channel]], created_at: Math.floor(Date.now() / 1000),
  });
  const t0 = performance.now();
  await bounded(event.sign(signer), "sign_event");
  let ms = performance.now() - t0;
  if (publish) {
    await bounded(event.publish(undefined, timeoutMs, 1), "publish");
    ms = performance.now() - t0;
  }
  // Checked outside the timed window (NDK's signer does not check it): the figure is the
  // round trip alone, the lowest the bunker baseline can honestly be.
  if (!event.sig || !event.verifySignature(false)) throw new Error("bunker returned a bad signature");
  return ms;
}

const latencies = [];
let failures = 0;
let cpu0;
for (let i = 0; i < warmup + n; i++) {
  if (i === warmup) cpu0 = process.cpuUsage();
  try {
    const ms = await once(i);
    if (i >= warmup) latencies.push(ms);
  } catch (e) {
    failures += 1;
    process.stderr.write(`request ${i}: ${e.message ?? e}\n`);
    if (failures > 3) fail(`too many failed requests (last: ${e.message ?? e})`);
  }
}
// This process's CPU (user + system) over the timed requests: where a round trip's time goes.
const cpu = process.cpuUsage(cpu0);
emit({ latencies_ms: latencies, failures, publish, cpu_ms: (cpu.user + cpu.system) / 1000 });
process.exit(0);
