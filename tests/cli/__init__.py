"""Tests for placement.cli: the ``placement`` command, one test module per concern."""
