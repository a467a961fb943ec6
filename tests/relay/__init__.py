"""Tests of daemon/relay/pool and daemon/relay/protocol, against LocalRelay and a scripted relay."""
