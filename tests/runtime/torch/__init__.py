"""Tests for placement.runtime.torch: running lowered modules (pipelines, executors, CUDA graphs)."""
