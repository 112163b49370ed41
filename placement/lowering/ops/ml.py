"""Ops of the ``ai.onnx.ml`` domain that are plain tensor arithmetic: ``Binarizer`` and
``ArrayFeatureExtractor`` (as ONNX Runtime computes them).

Example:
    >>> import torch
    >>> from placement.lowering.ops.ml import array_feature_extractor, binarizer
    >>> binarizer(torch.tensor([-1.0, 0.5, 2.0]), threshold=0.5).tolist()
    [0.0, 0.0, 1.0]
    >>> array_feature_extractor(torch.tensor([10, 20, 30]), torch.tensor([2, 0])).tolist()
    [[30, 10]]
"""

from __future__ import annotations

import torch

from placement.lowering.ops._registry import Tensor, op

_DOMAIN = "ai.onnx.ml"


@op("Binarizer", domain=_DOMAIN)
def binarizer(X: Tensor, *, threshold: float = 0.0) -> Tensor:
    """ONNX-ML Binarizer: 1 where ``X > threshold``, else 0, in ``X``'s type."""
    return (X > threshold).to(X.dtype)


@op("ArrayFeatureExtractor", domain=_DOMAIN)
def array_feature_extractor(X: Tensor, Y: Tensor) -> Tensor:
    """ONNX-ML ArrayFeatureExtractor: ``X[..., indices]`` (all indices, flattened); a 1-D ``X``
    gives one row, as ONNX Runtime."""
    index = Y.reshape(-1).to(device=X.device, dtype=torch.int64)
    picked = X.index_select(X.dim() - 1, index)
    return picked.reshape(1, -1) if X.dim() == 1 else picked


__all__ = ["binarizer", "array_feature_extractor"]
