"""Tests for daemon/pipeline/policy."""
