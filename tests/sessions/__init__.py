"""Tests for daemon/state/sessions."""
