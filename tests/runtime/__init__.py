"""Tests for placement.runtime."""
