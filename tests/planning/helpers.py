"""Helpers shared by the front-end, profiler and planner tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
import torch

import placement as pl
from placement.graph.nodes import SCOPE_KEY
from placement.models.gpt import GPTConfig

#: The 4-layer d=256 GPT-2 (20 MiB of weights) of ``benchmarks/offload_plans.py``'s ``small`` rows.
SMALL_GPT = GPTConfig(vocab_size=8192, block_size=32, n_layer=4, n_head=4, d_model=256)


def run_placed(model: pl.Model, args: tuple) -> list[np.ndarray]:
    """Run a placed model through ``pl.run`` (per-device stages) on the torch example args."""
    inputs = {name: a.numpy() for name, a in zip(model.inputs, args)}
    run = getattr(pl, "run", None)
    if run is None:  # the runtime is not exported yet: use its module directly
        from placement.runtime.ort import run
    return run(model, inputs)


def assert_matches_torch(model: pl.Model, net: torch.nn.Module, args: tuple) -> None:
    """The placed model gives the original module's outputs."""
    with torch.no_grad():
        expected = net(*args)
    if isinstance(expected, torch.Tensor):
        expected = (expected,)
    got = run_placed(model, args)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-5)


def devices_by_op(model: pl.Model) -> dict[str, str]:
    return {op.name: str(op.device) for op in model.ops}


def random_dag(seed: int, n_ops: int) -> pl.Model:
    """A random DAG of MatMul / Relu / Add ops with varying widths and some shared weights.

    Op ``k`` has scope ``m{k // 2}`` (two ops per "module"); every third op has no scope.
    """
    rng = np.random.default_rng(seed)
    widths = [2, 3, 5, 8]
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 4]))
    values: list[tuple[ir.Value, int]] = [(x, 4)]
    params: dict[tuple[int, int], ir.Value] = {}
    inits: list[ir.Value] = []
    nodes: list[ir.Node] = []
    for k in range(n_ops):
        src, width = values[int(rng.integers(max(0, len(values) - 3), len(values)))]
        kind = rng.choice(["MatMul", "Relu", "Add"])
        same = [v for v, w in values if w == width and v is not src]
        if kind == "Add" and not same:
            kind = "Relu"
        if kind == "MatMul":
            out_w = int(rng.choice(widths))
            key = (width, out_w)
            if key not in params or rng.random() < 0.5:
                name = f"w{len(inits)}"
                w = ir.Value(
                    name=name,
                    type=ir.TensorType(ir.DataType.FLOAT),
                    shape=ir.Shape([width, out_w]),
                    const_value=ir.tensor(rng.standard_normal((width, out_w)).astype(np.float32), name=name),
                )
                params[key] = w
                inits.append(w)
            node = ir.Node("", "MatMul", [src, params[key]], name=f"op{k}", num_outputs=1)
        elif kind == "Relu":
            out_w = width
            node = ir.Node("", "Relu", [src], name=f"op{k}", num_outputs=1)
        else:
            out_w = width
            other = same[int(rng.integers(len(same)))]
            node = ir.Node("", "Add", [src, other], name=f"op{k}", num_outputs=1)
        out = node.outputs[0]
        out.name = f"v{k}"
        out.type = ir.TensorType(ir.DataType.FLOAT)
        out.shape = ir.Shape([2, out_w])
        node.metadata_props[SCOPE_KEY] = "" if k % 3 == 2 else f"m{k // 2}"
        nodes.append(node)
        values.append((out, out_w))
    outputs = [values[-1][0]]
    extra = values[int(rng.integers(1, len(values)))][0]
    if extra is not outputs[0] and rng.random() < 0.5:
        outputs.append(extra)
    graph = ir.Graph([x], outputs, nodes=nodes, initializers=inits, opset_imports={"": 20}, name="dag")
    return pl.Model(ir.Model(graph, ir_version=10))


def all_ends(n: int, parts: int) -> Iterator[list[int]]:
    """Every contiguous partition of ``n`` ops into ``parts`` (possibly empty) parts, as ends."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), parts - 1):
        yield [*cuts, n]
