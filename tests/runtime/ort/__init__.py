"""Tests for placement.runtime.ort."""
