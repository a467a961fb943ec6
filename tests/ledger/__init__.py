"""Tests for daemon/state/ledger."""
