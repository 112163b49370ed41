"""Tensor parallelism as a pass: split ops *through* their weights over a group of devices.

Beside the trio that splits a model *between* ops, :func:`split_tensor_parallel` rewrites a
model on one device into an SPMD graph over a group (Megatron's column/row linears, attention
by heads, vocab-parallel embeddings, convolution channels), with collectives in standard ONNX
on top of copies (an all-reduce is a ``Sum`` of copied partials on each device, an all-gather a
``Concat``; node metadata tags each with its kind, group and id).

Modules: :mod:`.layouts` (replicated / sharded / partial values, head-aligned index lists),
:mod:`.rewriter` (per-device values, nodes, sliced parameters, collectives), :mod:`.weights`
(parameters seen through transposes, the column plan), :mod:`.rules_linear` (linears, convs,
embeddings), :mod:`.rules_shape` (element-wise, normalisation and shape ops), :mod:`.split`
(the driver).

May import: ``placement.errors``, ``placement.graph``, ``placement.analysis``, ``placement.passes``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.split_tensor_parallel(model, devices=[0, 1]).split
    ['node_linear', 'node_linear_1', 'node_linear_2']
"""

from __future__ import annotations

from placement.passes.tensor_parallel.split import TensorParallelResult, split_tensor_parallel

__all__ = ["split_tensor_parallel", "TensorParallelResult"]
