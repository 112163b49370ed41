"""Tests of placement.passes."""
