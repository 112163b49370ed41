"""Conformance: ONNX's node test suite on every runtime (see ``_cases``)."""
