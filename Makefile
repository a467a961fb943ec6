# buzz-broker: `make run` tries it, `make test` proves it. Both install what is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The tests start hundreds of Python processes (`buzz-broker` commands, daemons, relays), each
# importing the daemon: with PYTHONDONTWRITEBYTECODE set in the environment nothing of the
# checkout is ever cached, so every one of them compiled it again (~0.4 s a process here).
# Bytecode goes to __pycache__/ (git-ignored; the nspawn test's copy skips it).
unexport PYTHONDONTWRITEBYTECODE
# Debian packages the daemon, its tests and the demo need. softhsm2: the development token;
# opensc: pkcs11-tool for inspecting it; systemd: systemd-analyze for the unit lint;
# curl: the demo's first request; curl and node-typescript: docs/protocol.md's examples run
# by tests/docs (node itself: nodejs and npm, installed only when no `node` is on PATH, so a
# node from elsewhere is left alone; the one npm package the TypeScript example needs,
# @noble/curves, is installed by the test with `npm ci` from docs/examples/node's lockfile
# into a cache outside the checkout: tests/docs/node_deps.py). systemd-container +
# debootstrap: the real-systemd test boots a Debian 12 guest with systemd-nspawn
# (tests/nspawn/; it caches the image and a wheel cache under /var/cache/buzz-broker-tests,
# outside the checkout).
APT_PACKAGES := softhsm2 opensc systemd curl node-typescript systemd-container debootstrap
# The other PKCS#11 tokens the custody suite runs on (tests/tokens/kinds.py says which kind
# needs which): a software TPM 2.0 with tpm2-pkcs11, opencryptoki's software token, and a
# SoftHSM token behind `p11-kit server`. age: `age-keygen` for backup identities.
TOKEN_PACKAGES := swtpm swtpm-tools tpm2-tools tpm2-abrmd libtss2-tcti-tabrmd0 libtpm2-pkcs11-1 libtpm2-pkcs11-tools opencryptoki p11-kit p11-kit-modules dbus util-linux
APT_PACKAGES += $(TOKEN_PACKAGES) age

.PHONY: all run stop test test-tokens deps venv lint bench clean

all: test

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import venv, ensurepip' >/dev/null 2>&1 || missing="$$missing python3-venv"; \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml | deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: deps $(VENV)/.installed

# The main suite on TEST_WORKERS xdist workers, a module to a worker at a time (loadscope),
# so module and session fixtures (token, relay, a module's daemon) are made once per worker,
# in collection order (tests/conftest.py puts the slow nspawn guest first). Much of the suite
# waits on subprocesses and relays: two workers on two cores take ~60-70% of the serial time.
# TEST_WORKERS=0 runs it in this process, serially.
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
	$(MAKE) --no-print-directory test-tokens

# The custody suite once per other token kind, each token started and torn down by
# with-token (the main suite above already ran it on SoftHSM, its own token). Tests marked
# token_independent open no session token (tests/fixtures/token.py): the main suite ran
# them, so the other kinds skip them.
# The kinds run at once, each on its own token (its own temp dir, ports and sockets; the
# opencryptoki one in its own namespace), each kind's output held in a file and printed
# whole, in TOKEN_KINDS order, when all are done.
# TOKEN_KINDS=tpm make test-tokens runs one kind; softhsm is a kind too.
TOKEN_KINDS ?= tpm opencryptoki p11kit
CUSTODY_SUITE := tests/custody tests/tokens tests/backup
test-tokens: venv
	@out=$$(mktemp -d); for k in $(TOKEN_KINDS); do \
	  { $(PY) tests/tokens/with-token $$k -- $(PY) -m pytest -q -p no:cacheprovider -m "not token_independent" $(CUSTODY_SUITE) \
	      >$$out/$$k.log 2>&1; echo $$? >$$out/$$k.status; } & done; wait; \
	failed=""; for k in $(TOKEN_KINDS); do echo "== custody suite on the $$k token"; cat $$out/$$k.log; \
	  [ "$$(cat $$out/$$k.status)" = 0 ] || failed="$$failed $$k"; done; rm -rf $$out; \
	if [ -n "$$failed" ]; then echo "custody suite failed on:$$failed"; exit 1; fi

lint: venv
	$(PY) -m mypy daemon custody buzzwire client/buzz_broker_client

run: venv
	$(PY) -m tests.demo

# Ends the demo `make run` started (its daemon and relay with it), from any shell.
stop:
	@$(PY) -m tests.demo --stop

# Each benchmark prints its figures beside a baseline from the same run. load.py, e2e.py and
# startup.py take options (see --help); _harness.py and null_relay.py are not benchmarks.
# fleet.py is not in the list: it takes minutes and builds its pinned baseline once; its
# command is in docs/performance.md ("A Buzz-shaped fleet").
BENCHMARKS := contract custody ledger audit read poll read_disk relay_connections startup e2e bunker authenticate seals tokens
bench: venv
	for b in $(BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) run build *.egg-info
