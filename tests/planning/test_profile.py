"""Tests for the profiler: times, bytes, FLOPs, caching and liveness-based peak memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement as pl
from placement.planning.graph_info import GraphInfo, peak_activation_bytes
from placement.planning.profile import make_sample_inputs, op_flops
from tests.graph.builders import mlp_graph
from tests.planning.helpers import random_dag


def test_profile_measures_every_op_and_caches(exported):
    model, _, args = exported("mlp")
    prof = pl.profile(model, repeats=2)
    assert list(prof.ops) == [op.name for op in model.ops]
    assert prof.backend == "ort" and prof.has_time
    assert all(p.time_s is not None and p.time_s >= 0 for p in prof.ops.values())
    assert prof.total_time_s > 0
    assert sum(p.param_bytes for p in prof.ops.values()) == sum(p.nbytes for p in model.parameters.values())
    assert pl.profile(model, repeats=2) is prof
    assert pl.profile(model, time=False) is prof  # a timed profile serves static requests
    pl.balance(model, [2, 3])  # placement does not invalidate the cache
    assert pl.profile(model, repeats=2) is prof
    assert pl.profile(model, repeats=2, refresh=True) is not prof
    explicit = pl.profile(model, sample_inputs=[args[0]], repeats=1)
    assert explicit.has_time
    assert json_ready(prof.to_dict())


def json_ready(data) -> bool:
    import json

    return bool(json.dumps(data))


def test_profile_sample_input_errors(exported):
    model, _, args = exported("mlp")
    with pytest.raises(pl.InputError, match="unknown input"):
        pl.profile(model, sample_inputs={"nope": args[0]})
    with pytest.raises(pl.InputError, match="missing input"):
        pl.profile(model, sample_inputs={})
    with pytest.raises(pl.InputError, match="got 2 sample inputs"):
        pl.profile(model, sample_inputs=[args[0], args[0]])
    with pytest.raises(pl.PlanError):
        pl.profile(model, repeats=0)


def test_sample_inputs_use_zero_token_ids(exported):
    model, _, _ = exported("gpt")
    inputs = make_sample_inputs(model)
    (idx,) = inputs.values()
    assert idx.dtype == np.int64 and not idx.any()
    assert pl.profile(model, repeats=1).has_time  # valid embedding lookups


def test_size_and_flops_costs(exported):
    model, _, _ = exported("mlp")
    prof = pl.profile(model, time=False)
    assert prof.backend == "static" and not prof.has_time
    with pytest.raises(pl.PlanError, match="no measured times"):
        prof.costs("time")
    with pytest.raises(pl.PlanError, match="unknown cost"):
        prof.costs("joules")
    gemm = model.ops[0].node
    (m, k) = gemm.inputs[0].shape
    n = gemm.outputs[0].shape[1]
    assert op_flops(gemm) == 2 * m * n * k + m * n
    assert prof.costs("flops")[1] == m * n  # Relu: one per element
    sizes = prof.costs("size")
    assert sizes[0] == (k * n + n) * 4 + m * n * 4


def test_conv_and_matmul_flops(exported):
    model, _, _ = exported("resnet")
    conv = next(op.node for op in model.ops if op.op_type == "Conv")
    w = conv.inputs[1].shape
    out = conv.outputs[0].shape
    assert op_flops(conv) == 2 * int(np.prod(list(out))) * int(np.prod(list(w)[1:]))
    model, _, _ = exported("gpt")
    prof = pl.profile(model, time=False)
    names = [op.name for op in model.ops]
    # c_attn: (2, 8, 32) @ (32, 96) -- its output is shaped by ONNX shape inference
    c_attn = next(op for op in model.ops if op.op_type == "MatMul" and op.scope == "blocks.0.attn.c_attn")
    assert prof.costs("flops")[names.index(c_attn.name)] == 2 * 32 * (2 * 8 * 96)
    assert prof.ops[c_attn.name].output_bytes == 2 * 8 * 96 * 4


def test_a_load_time_transpose_is_parameter_memory_not_output(exported):
    """The exporter's transpose of a weight is computed once at load time: like GraphInfo, the
    profile counts it with the parameters (0 output bytes), so ``balance_by_size`` does not weigh
    a weight twice; the per-step outputs are counted as before."""
    model, _, _ = exported("gpt")
    info = GraphInfo(model)
    prof = pl.profile(model, time=False)
    fixed = [pos for pos in range(len(info)) if info.op_fixed[pos] and info.nodes[pos].op_type == "Transpose"]
    assert fixed and all(sum(info.blob_bytes[b] for b in info.op_outputs[pos]) > 0 for pos in fixed)
    assert all(prof.ops[info.names[pos]].output_bytes == 0 for pos in fixed)
    per_step = [pos for pos in range(len(info)) if not info.op_fixed[pos]]
    for pos in per_step:
        assert prof.ops[info.names[pos]].output_bytes == sum(info.step_bytes[b] for b in info.op_outputs[pos])
    assert prof.total_output_bytes == sum(info.step_bytes[b] for outs in info.op_outputs for b in outs)
    assert sum(p.param_bytes for p in prof.ops.values()) == sum(p.nbytes for p in model.parameters.values())


def test_flops_of_a_dynamic_batch_count_the_sample_batch():
    """A model exported with a dynamic batch (as pipelining needs) has symbolic shapes; its
    FLOPs count for the sample inputs' batch (one example without them), not as zero, so
    ``auto_place(cost="flops")`` balances it as it balances the static export."""
    import torch

    from placement.models import gpt

    net, (idx,) = gpt.build("tiny")
    static = pl.from_torch(net, (idx,))
    dynamic = pl.from_torch(net, (idx,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    want = sum(pl.profile(static, time=False).costs("flops"))
    sample = [idx.numpy()]
    got = sum(pl.profile(dynamic, time=False, sample_inputs=sample).costs("flops"))
    assert want > 0 and got == pytest.approx(want, rel=1e-3)  # the dynamic export adds shape ops
    one = sum(pl.profile(dynamic, time=False).costs("flops"))  # every symbol counts as 1
    assert 0 < one < want
    for model in (static, dynamic):
        plan = pl.auto_place(model, devices=2, cost="flops", sample_inputs=sample)
        costs = [d.cost for d in plan.devices]
        assert max(costs) < 0.6 * sum(costs), plan


def test_peak_activation_by_hand():
    # x -> fc0 -> relu0 -> fc1 -> relu1 -> fc2 -> relu2: blobs of 2x4 floats (32 B)
    model = mlp_graph(3, 4)
    assert peak_activation_bytes(model) == {pl.Device("cuda", 0): 64}
    info = GraphInfo(model)
    assert info.segment_param_bytes(0, 6) == 3 * 64
    # split after fc1: fc1's output stays on device 0 until its stage ends, arrives on 1
    for op in model.ops[3:]:
        model.set_device(op.name, 1)
    peaks = peak_activation_bytes(model)
    assert peaks == {pl.Device("cuda", 0): 64, pl.Device("cuda", 1): 64}
    assert info.segment_in_bytes(3, 6) == 32 and info.segment_in_bytes(0, 3) == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_ops=st.integers(1, 12), data=st.data())
def test_segment_memory_agrees_with_general_liveness_and_is_monotone(seed, n_ops, data):
    info = GraphInfo(random_dag(seed, n_ops))
    n = len(info)
    cut = data.draw(st.integers(0, n))
    part = [0 if pos < cut else 1 for pos in range(n)]
    peaks = info.peak_activations(part, 2)
    assert peaks[0] == info.segment_peak_activation(0, cut)
    assert peaks[1] == info.segment_peak_activation(cut, n)
    params = info.part_param_bytes(part, 2)
    assert params == [info.segment_param_bytes(0, cut), info.segment_param_bytes(cut, n)]
    i = data.draw(st.integers(0, n))
    j = data.draw(st.integers(i, n))
    a = data.draw(st.integers(i, j))
    b = data.draw(st.integers(a, j))
    assert info.segment_memory(a, b) <= info.segment_memory(i, j)  # what makes the greedy exact
    out, into = info.transfers(part, 2)
    assert into[1] == info.segment_in_bytes(cut, n) and out[0] == into[1]


def test_profiler_failures_are_plan_errors(exported):
    model, _, args = exported("gpt")
    tokens = args[0].numpy().copy()
    tokens[0, 0] = 10**6  # no such token id: ONNX Runtime fails inside the timing run
    with pytest.raises(pl.PlanError, match="profiling failed.*could not run"):
        pl.profile(model, sample_inputs=[tokens])
    with pytest.raises(pl.PlanError, match="profiling failed"):
        pl.auto_place(model, devices=2, sample_inputs=[tokens], repeats=1)
    assert [str(d) for d in model.devices] == ["cuda:0"]  # the model is unchanged


def test_optimized_profile_gives_fused_nodes_to_their_ops(exported):
    """ONNX Runtime fuses Conv+BatchNormalization(+Add)+Relu into one node named after
    the chain's output: with ``optimized=True`` one op of each chain carries its time
    and the ops folded into it cost nothing; op-by-op timing gives every op a time."""
    model, _, _ = exported("resnet")
    prof = pl.profile(model, repeats=1, optimized=True)
    plain = pl.profile(model, repeats=1)
    assert prof is not plain and prof.has_time and prof.total_time_s > 0
    assert set(prof.ops) == set(plain.ops) and all(p.time_s >= 0 for p in prof.ops.values())
    timed = {name for name, p in prof.ops.items() if p.time_s > 0}
    convs = [name for name, p in prof.ops.items() if p.op_type == "Conv"]
    assert len(timed) < len(prof.ops) and not set(convs) <= timed  # fused away
    assert all(plain.ops[name].time_s > 0 for name in convs)


def test_time_planning_a_model_with_an_unread_large_weight():
    # A 64x64 initializer nothing reads (dead weights are common in exported files): ONNX Runtime
    # drops it when it loads the graph, so handing it over as a supplied weight failed profiling.
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((64, 64), np.float32), name) for name in ("w", "unused")
    ]
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        oh.make_node("Relu", ["h"], ["r"], name="relu"),
        oh.make_node("Tanh", ["r"], ["y"], name="tanh"),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        initializer=weights,
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(proto)
    model = pl.load(proto)
    for optimized in (False, True):
        prof = pl.profile(model, repeats=1, optimized=optimized, refresh=True)
        assert prof.has_time and set(prof.ops) == {"mm", "relu", "tanh"}
    from placement.planning.fusion import _optimized_value_names

    assert {"x", "y"} <= _optimized_value_names(model)  # the fusion probe's session builds too
    pl.auto_place(model, devices=2, cost="time", repeats=1)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    expected = np.tanh(np.maximum(x @ numpy_helper.to_array(weights[0]), 0))
    np.testing.assert_allclose(pl.run(model, {"x": x})[0], expected, rtol=1e-4, atol=1e-5)
