"""Tests for daemon/sessions."""
