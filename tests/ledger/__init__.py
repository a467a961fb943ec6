"""Tests for daemon/ledger."""
