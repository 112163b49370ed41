"""Quantized weights in the offload plan and in streaming: ``quantize_dynamic``'s int8 weights
count in the plan's memory, and streaming them gives ONNX Runtime's outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import placement as pl
from placement.models import gpt
from placement.runtime.torch.copy_emulation import EmulatedCopyEngine


@pytest.fixture(scope="module")
def quantized_gpt(tmp_path_factory) -> tuple[Path, tuple[torch.Tensor, ...]]:
    """gpt tiny through ORT's ``quant_pre_process`` and ``quantize_dynamic`` (int8 weights)."""
    tmp_path = tmp_path_factory.mktemp("int8")
    quantization = pytest.importorskip("onnxruntime.quantization")
    from onnxruntime.quantization.shape_inference import quant_pre_process

    net, args = gpt.build("tiny")
    source, folded, target = (tmp_path / f"{n}.onnx" for n in ("gpt", "folded", "int8"))
    pl.from_torch(net, args).save(source)
    quant_pre_process(str(source), str(folded), skip_symbolic_shape=True)
    quantization.quantize_dynamic(folded, target, weight_type=quantization.QuantType.QInt8)
    return target, args


def _weights(model: pl.Model) -> tuple[int, int]:
    """Bytes of the integer and floating-point initializers of at least one dimension."""
    ints = floats = 0
    for value in model.graph.initializers.values():
        data = value.const_value
        if data is None or len(data.shape) < 1 or data.dtype.name in ("INT64", "BOOL"):
            continue
        if data.dtype.is_floating_point():
            floats += data.nbytes
        else:
            ints += data.nbytes
    return ints, floats


def test_int8_weights_count_in_the_plan(quantized_gpt):
    path, _ = quantized_gpt
    model = pl.load(path)
    ints, floats = _weights(model)
    assert ints > 5 * floats  # the int8 weights are most of the model
    plan = pl.plan_offload(model, {0: "1GiB", "cpu": "1GiB"}, cost="flops", workspace=0)
    counted = sum(layer.param_bytes for layer in plan.layers)
    assert counted >= ints
    assert plan.gpu_bytes >= ints + plan.activation_bytes  # all resident: every weight on the GPU
    tight = pl.plan_offload(model, {0: ints, "cpu": "1GiB"}, cost="flops", workspace=0)
    assert set(tight.modes.values()) != {"resident"} and tight.gpu_bytes <= ints
    assert (
        any(
            model.graph.initializers[name].const_value.dtype.name == "INT8"
            for name in tight.streamed_parameters()
        )
        or "host" in tight.modes.values()
    )


def test_streamed_int8_weights_lower_and_match_ort(quantized_gpt):
    import onnxruntime as ort

    path, args = quantized_gpt
    model = pl.load(path)
    (expected,) = ort.InferenceSession(str(path)).run(None, {model.inputs[0]: args[0].numpy()})
    int8 = [
        n
        for n, v in model.graph.initializers.items()
        if n.endswith("_quantized") and v.const_value is not None
    ]
    result = pl.stream_parameters(model, int8)
    assert set(result.streamed) == set(int8)
    pl.inject_cross_device_copies(model, output_device=0)
    module = pl.to_torch(model, device_map={"cuda:0": "cpu", "cpu": "cpu"})
    streamer = module.weight_streamer
    assert len(streamer.sizes) >= len(int8)
    engine = streamer.use(EmulatedCopyEngine(latency=0.001, seed=6))
    try:
        with torch.no_grad():
            got = [module(*args) for _ in range(2)]
    finally:
        engine.close()
    for out in got:
        np.testing.assert_allclose(out.numpy(), expected, atol=1e-5, rtol=0)
    assert streamer.prefetched > 0


def test_streaming_a_shape_tensor_is_a_named_error(exported):
    model, _, _ = exported("gpt")
    shapes = [
        n
        for n, v in model.graph.initializers.items()
        if v.const_value is not None and v.const_value.dtype.name == "INT64"
    ]
    assert shapes
    before = dict(model.streamed)
    with pytest.raises(pl.PlanError, match=repr(shapes[0])):
        pl.stream_parameters(model, [shapes[0]])
    assert dict(model.streamed) == before
