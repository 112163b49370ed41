"""A synthetic big model written straight to disk: a chain of large MatMuls.

``write_matmul_chain`` writes ``x -> (MatMul -> Tanh) * n -> y`` as standard ONNX
with every weight in one external data file, generating the weights in chunks so
that writing a model of many GiB needs little memory. No download, no torch.
Used by the big-model test and ``benchmarks/bigmodel.py``.

Example:
    >>> import os, tempfile
    >>> from placement.models.synthetic import write_matmul_chain
    >>> folder = tempfile.mkdtemp()
    >>> weight_bytes = write_matmul_chain(os.path.join(folder, "big.onnx"), layers=2, width=64)
    >>> weight_bytes
    32768
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["write_matmul_chain", "DATA_FILE"]

#: Name of the external data file written beside the model.
DATA_FILE = "weights.data"
_CHUNK_BYTES = 64 * 2**20


def write_matmul_chain(
    path: str | os.PathLike[str], *, layers: int = 10, width: int = 8192, batch: int = 2, seed: int = 0
) -> int:
    """Write the chain to ``path`` (+ ``weights.data`` beside it); return the weight bytes.

    Each of the ``layers`` weights is ``width x width`` float32 (256 MiB at the
    default width, so the default model holds 2.5 GiB), scaled so activations stay
    in Tanh's linear range. The input ``x`` is ``batch x width`` float32.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / np.sqrt(width))
    rows_per_chunk = max(1, _CHUNK_BYTES // (4 * width))
    initializers, nodes = [], []
    offset = 0
    with open(path.parent / DATA_FILE, "wb") as f:
        for i in range(layers):
            # One random chunk per layer, rolled for the rest: fast, and still a weight
            # whose every row differs, so a mix-up of layers or offsets shows in the outputs.
            base = rng.standard_normal((min(rows_per_chunk, width), width), dtype=np.float32)
            base *= scale
            for k, start in enumerate(range(0, width, rows_per_chunk)):
                rows = min(rows_per_chunk, width - start)
                f.write(np.roll(base, 7 * k + 1, axis=1)[:rows].tobytes())
            tensor = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[width, width])
            tensor.data_location = TensorProto.EXTERNAL
            length = 4 * width * width
            for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += length
            initializers.append(tensor)
            source = "x" if i == 0 else f"h{i - 1}"
            nodes.append(helper.make_node("MatMul", [source, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"))
            out = "y" if i == layers - 1 else f"h{i}"
            nodes.append(helper.make_node("Tanh", [f"mm{i}"], [out], name=f"tanh{i}"))
    graph = helper.make_graph(
        nodes,
        "matmul_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save_model(model, path)
    return offset
