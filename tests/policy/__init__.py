"""Tests for daemon/policy."""
