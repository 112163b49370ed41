"""Device-resident runs: ``Runner.run`` on torch tensors and ``OrtValue`` s, outputs as torch or OrtValues.

On the CPU (logical devices emulated) the values are host memory, so what is proved here is
the API and that nothing is copied: inputs are read through DLPack over the caller's memory,
outputs come back over the run's own buffers, and every output owns its memory. The ``gpu``
tests run the same on CUDA tensors and check that no tensor goes through the host.
"""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
import pytest
import torch

import placement as pl
from placement.runtime.inputs import ortvalue_from_torch
from placement.runtime.ort.values import HOST_COPIES, to_output

ATOL = 1e-5


@functools.cache
def _placed(name: str, dynamic: bool = False):
    from placement import models

    net, args = models.build(name, "tiny")
    shapes = tuple({0: torch.export.Dim("batch")} for _ in args) if dynamic else None
    model = pl.from_torch(net, args, dynamic_shapes=shapes)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model, net, args


def _reference(net, args):
    with torch.no_grad():
        return net(*args).numpy()


@pytest.mark.parametrize("kind", ["torch", "ortvalue", "numpy"])
@pytest.mark.parametrize("given", ["torch", "ortvalue", "numpy"])
def test_inputs_and_outputs_of_every_kind(given, kind):
    model, net, args = _placed("gpt")
    runner = pl.Runner(model, device_map="cpu")
    feeds = {
        "torch": list(args),
        "ortvalue": [ort.OrtValue.ortvalue_from_numpy(a.numpy()) for a in args],
        "numpy": [a.numpy() for a in args],
    }[given]
    (out,) = runner.run(feeds, outputs=kind)
    expected_type = {"torch": torch.Tensor, "ortvalue": ort.OrtValue, "numpy": np.ndarray}[kind]
    assert isinstance(out, expected_type)
    host = out.numpy() if kind != "numpy" else out
    np.testing.assert_allclose(host, _reference(net, args), atol=1e-4)
    assert runner.stats.host_copies == 0  # emulated devices share host memory: nothing to copy


def test_torch_input_is_read_without_a_copy():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = ortvalue_from_torch(tensor)
    assert value.data_ptr() == tensor.data_ptr()
    flags = ortvalue_from_torch(torch.tensor([True, False]))
    assert flags.data_type() == "tensor(bool)"
    np.testing.assert_array_equal(flags.numpy(), [True, False])
    strided = ortvalue_from_torch(tensor[:, 1:])  # made contiguous first
    np.testing.assert_array_equal(strided.numpy(), tensor[:, 1:].numpy())


def test_torch_output_shares_the_runs_buffer():
    value = ort.OrtValue.ortvalue_from_numpy(np.arange(6, dtype=np.float32))
    tensor = to_output(value, "torch")
    assert tensor.data_ptr() == value.data_ptr()
    copied = to_output(value, "torch", copy=True)
    assert copied.data_ptr() != value.data_ptr()
    np.testing.assert_array_equal(copied.numpy(), value.numpy())
    flags = to_output(ort.OrtValue.ortvalue_from_numpy(np.array([True, False])), "torch")
    assert flags.dtype == torch.bool


@pytest.mark.parametrize("kind", ["torch", "ortvalue"])
def test_device_outputs_own_their_memory(kind):
    model, net, args = _placed("mlp")
    runner = pl.Runner(model, device_map="cpu")
    (first,) = runner.run(list(args), outputs=kind)
    kept = np.array(first.numpy())
    for _ in range(3):
        runner.run([2 * a for a in args], outputs=kind)
    np.testing.assert_array_equal(first.numpy(), kept)


def test_an_input_passed_through_is_copied():
    x = torch.randn(2, 3)
    model = pl.from_torch(torch.nn.Sequential(torch.nn.ReLU()), (x,))
    model.ir_model.graph.outputs.append(model.ir_model.graph.inputs[0])  # the input is an output too
    runner = pl.Runner(model, device_map="cpu")
    relu, echo = runner.run([x], outputs="torch")
    assert echo.data_ptr() != x.data_ptr()
    torch.testing.assert_close(echo, x)
    torch.testing.assert_close(relu, x.relu())


def test_pipelined_run_on_device_values():
    model, net, args = _placed("gpt", dynamic=True)
    batch = tuple(torch.cat([a, a.flip(0), a])[:5] for a in args)
    runner = pl.Runner(model, device_map="cpu", chunks=2)
    expected = _reference(net, batch)
    (got,) = runner.run([ort.OrtValue.ortvalue_from_numpy(b.numpy()) for b in batch], outputs="torch")
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)
    (value,) = runner.run(list(batch), outputs="ortvalue")
    np.testing.assert_allclose(value.numpy(), expected, atol=1e-4)
    (array,) = runner.run(list(batch))
    np.testing.assert_allclose(array, expected, atol=1e-4)


def test_bad_output_kind_and_bad_device_input_are_named():
    model, net, args = _placed("mlp")
    runner = pl.Runner(model, device_map="cpu")
    with pytest.raises(pl.InputError, match="outputs must be one of"):
        runner.run(list(args), outputs="cupy")
    wrong = ort.OrtValue.ortvalue_from_numpy(np.zeros((4, 3), np.float32))
    with pytest.raises(pl.InputError, match="input 'input'"):
        runner.run([wrong], outputs="torch")
    with pytest.raises(pl.InputError, match="dtype"):
        runner.run([ort.OrtValue.ortvalue_from_numpy(args[0].numpy().astype(np.float64))])


def test_run_function_takes_outputs():
    model, net, args = _placed("mlp")
    (out,) = pl.run(model, list(args), device_map="cpu", outputs="torch")
    np.testing.assert_allclose(out.numpy(), _reference(net, args), atol=ATOL)


# --- on a GPU ----------------------------------------------------------------------------------


def _close_to_eager(runner, out, want):
    """Within the tolerance of the runner's precision (fp32 by default: TF32 off)."""
    tol = runner.tolerance
    np.testing.assert_allclose(out, want, atol=tol.atol, rtol=tol.rtol, err_msg=str(tol))


#: two logical devices on one GPU: folded into one session (the default), or stages kept apart
ONE_GPU_FOLDS = pytest.mark.parametrize("fold", [None, False], ids=["folded", "stages"])


@pytest.mark.gpu
@ONE_GPU_FOLDS
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_cuda_tensors_stay_on_the_gpu(name, fold):
    model, net, args = _placed(name)
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}, fold=fold)
    assert len(runner.stages) == (1 if fold is None else 2)
    inputs = [a.cuda() for a in args]
    before = HOST_COPIES.count
    (out,) = runner.run(inputs, outputs="torch")
    assert HOST_COPIES.count == before and runner.stats.host_copies == 0
    assert out.device.type == "cuda"
    _close_to_eager(runner, out.cpu().numpy(), _reference(net, args))
    (value,) = runner.run(inputs, outputs="ortvalue")
    assert value.device_name().lower() == "cuda" and runner.stats.host_copies == 0
    (host,) = runner.run(inputs)  # numpy out: exactly one copy to the host, the output's
    assert runner.stats.host_copies == 1
    np.testing.assert_allclose(host, out.cpu().numpy(), atol=1e-5)


@pytest.mark.gpu
@ONE_GPU_FOLDS
def test_cuda_pipelined_split_and_join_on_the_gpu(fold):
    model, net, args = _placed("gpt", dynamic=True)
    batch = tuple(torch.cat([a, a.flip(0), a])[:5] for a in args)
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}, chunks=2, fold=fold)
    assert len(runner.stages) == (1 if fold is None else 2)
    (out,) = runner.run([b.cuda() for b in batch], outputs="torch")
    assert out.device.type == "cuda" and runner.stats.host_copies == 0
    _close_to_eager(runner, out.cpu().numpy(), _reference(net, batch))


@pytest.mark.gpu
@ONE_GPU_FOLDS
def test_stage_sessions_of_one_gpu_share_an_arena(fold):
    from placement.runtime.device_map import PhysicalDevice
    from placement.runtime.ort.sessions import shared_cuda_allocator

    model, net, args = _placed("gpt")
    runner = pl.Runner(model, device_map={0: "cuda:0", 1: "cuda:0"}, fold=fold)
    assert len(runner.stages) == (1 if fold is None else 2)
    assert shared_cuda_allocator(PhysicalDevice("cuda", 0))
    assert set(runner.stats.providers.values()) == {"CUDAExecutionProvider"}
    (out,) = runner.run([a.cuda() for a in args], outputs="torch")
    _close_to_eager(runner, out.cpu().numpy(), _reference(net, args))


@pytest.mark.parametrize("chunks", [1, 2])
def test_stream_hands_back_device_outputs(chunks):
    model, net, args = _placed("gpt", dynamic=True)
    batch = tuple(torch.cat([a, a.flip(0)]) for a in args)
    runner = pl.Runner(model, device_map="cpu", chunks=chunks)
    feeds = [list(batch), [ort.OrtValue.ortvalue_from_numpy(b.numpy()) for b in batch]]
    for kind, expected_type in (("torch", torch.Tensor), ("ortvalue", ort.OrtValue)):
        outs = list(runner.stream(feeds, outputs=kind))
        assert len(outs) == 2 and all(isinstance(o[0], expected_type) for o in outs)
        for (out,) in outs:
            np.testing.assert_allclose(np.asarray(out.numpy()), _reference(net, batch), atol=1e-4)
