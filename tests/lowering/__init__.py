"""Tests for placement.lowering: the ONNX -> torch.fx translation and its op rules."""
