"""Tests of daemon/relay and daemon/relay_protocol, against LocalRelay and a scripted relay."""
