"""GraphInfo's memory model on the tiny GPT, whose exporter transposes every Linear weight with a
``Transpose`` op: load-time values are parameter memory where they are read, not activations.

The proof is a rewrite: the same model with each weight transpose folded into a pre-transposed
initializer (what ONNX Runtime does at session creation) computes the same outputs and must get
the same memory figures, segment by segment, part by part, and the same smallest budget from
``auto_place``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import placement as pl
from placement.planning.graph_info import GraphInfo
from tests.planning.helpers import run_placed


def _fold_weight_transposes(model: pl.Model) -> tuple[pl.Model, dict[str, int]]:
    """A copy of ``model`` whose ``Transpose`` ops of an initializer are initializers instead;
    with the bytes of each folded weight by the name of the op that read it."""
    folded = model.copy()
    graph = folded.graph
    inits = graph.initializers
    readers: dict[str, int] = {}
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" else None
        if source is None or source.name not in inits or source.const_value is None:
            continue
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
        array = np.transpose(source.const_value.numpy(), perm)
        out = node.outputs[0]
        value = ir.Value(name=f"{source.name}.T", shape=ir.Shape(array.shape), type=out.type)
        value.const_value = ir.tensor(np.ascontiguousarray(array), name=value.name)
        graph.register_initializer(value)
        for consumer, _ in list(out.uses()):
            readers[consumer.name or ""] = array.nbytes
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        if not source.uses():
            del inits[source.name]
    return folded, readers


@pytest.fixture(scope="module")
def gpt_pair():
    from tests.conftest import export_once

    model, net, args = export_once("gpt")
    folded, readers = _fold_weight_transposes(model)
    return model, folded, readers, args


def test_the_exported_gpt_transposes_its_weights_at_load_time(gpt_pair):
    model, folded, readers, args = gpt_pair
    info = GraphInfo(model)
    transposes = [
        pos for pos, node in enumerate(info.nodes) if node.op_type == "Transpose" and info.op_fixed[pos]
    ]
    assert len(transposes) >= 4 and len(readers) == len(transposes)
    for pos in transposes:
        assert [info.param_names[k].endswith("weight") for k in info.op_params[pos]] == [True]
        assert info.held_params[pos] == [] and all(info.blob_fixed[b] for b in info.op_outputs[pos])
    for got, want in zip(run_placed(folded, args), run_placed(model, args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_memory_figures_match_the_folded_model(gpt_pair):
    model, folded, readers, _ = gpt_pair
    info, ref = GraphInfo(model), GraphInfo(folded)
    n, m = len(info), len(ref)
    assert n - m == len(readers)
    assert info.segment_peak_activation(0, n) == ref.segment_peak_activation(0, m)
    assert info.segment_param_bytes(0, n) == ref.segment_param_bytes(0, m)
    # every cut of the folded model, at the same op in the original
    for c in range(1, m):
        at = info.position[ref.names[c]]
        assert info.segment_memory(0, at) == ref.segment_memory(0, c), ref.names[c]
        assert info.segment_memory(at, n) == ref.segment_memory(c, m), ref.names[c]
        part = [int(pos >= at) for pos in range(n)]
        ref_part = [int(pos >= c) for pos in range(m)]
        assert info.peak_activations(part, 2) == ref.peak_activations(ref_part, 2)
        assert info.part_param_bytes(part, 2) == ref.part_param_bytes(ref_part, 2)
        assert info.transfers(part, 2) == ref.transfers(ref_part, 2)


def test_auto_place_needs_the_same_smallest_budget_as_the_folded_model(gpt_pair):
    model, folded, _, _ = gpt_pair
    smallest = []
    for candidate in (model.copy(), folded.copy()):
        with pytest.raises(pl.InfeasiblePlacementError) as err:
            pl.auto_place(candidate, max_memory={0: "10KB", 1: "10KB"}, cost="size")
        smallest.append(int(str(err.value).split("(")[-1].split(" bytes")[0]))
    assert smallest[0] == smallest[1]
    placed = model.copy()
    plan = pl.auto_place(placed, max_memory={0: smallest[0], 1: smallest[0]}, cost="size")
    assert plan.fits
