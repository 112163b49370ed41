"""Pipeline stages as per-signature TorchScript traces (placement.runtime.torch.traced)."""

from __future__ import annotations

import warnings

import pytest
import torch

from placement.runtime.torch.traced import TracedStage


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _run(stage, *args):
    with torch.no_grad():
        return stage(*args)


def test_trace_equals_module_and_waits_for_warmup():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    stage = TracedStage(net, warmup=2)
    x = torch.randn(3, 4)
    want = net(x).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [_run(stage, x) for _ in range(4)]
    assert not caught  # tracing's own warnings (deprecation, tracer) stay quiet
    assert stage.traced == 1 and stage.disabled is None
    for out in outs:
        assert torch.equal(out, want)
    stage(x)  # grad mode on: the module itself (autograd as usual)
    assert stage(x).requires_grad
    stage.enabled = False
    assert torch.equal(_run(stage, x), want) and stage.traced == 1


def test_shapes_read_as_values_get_one_trace_per_shape():
    # Like ONNX Shape -> Reshape: a reshape target computed from the input's shape.
    def flip_dims(x):
        dims = torch.tensor(list(x.shape), dtype=torch.int64).flip(0)
        return x.reshape(dims.tolist()) * 2

    stage = TracedStage(_Fn(flip_dims), warmup=0)
    for shape in [(2, 3), (4, 3), (2, 3), (1, 5)]:
        x = torch.randn(shape)
        assert torch.equal(_run(stage, x), flip_dims(x))
    assert stage.traced == 3 and stage.disabled is None


def test_small_integer_input_read_as_value_keys_the_trace():
    stage = TracedStage(_Fn(lambda x, n: x[: int(n)] + 1), warmup=0)
    x = torch.randn(5, 2)
    for n in (2, 3, 2, 5):
        assert torch.equal(_run(stage, x, torch.tensor(n)), x[:n] + 1)
    assert stage._keyed == (1,) and stage.traced == 3


def test_fixed_inputs_do_not_key_and_updates_are_seen():
    w = torch.ones(2, 2)
    stage = TracedStage(_Fn(lambda x, w: x @ w), fixed=[1], warmup=0)
    x = torch.ones(1, 2)
    assert torch.equal(_run(stage, x, w), torch.full((1, 2), 2.0))
    w.mul_(3)  # a trained parameter: the trace reads it, it does not copy it
    assert torch.equal(_run(stage, x, w), torch.full((1, 2), 6.0))
    assert stage.traced == 1


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * 2 if bool(x.sum() > 0) else -x,  # control flow on data
        lambda x: x[torch.nonzero(x > 0)[:, 0]],  # a value-dependent shape
        lambda x: x[x > 0],  # boolean mask
        lambda x: x[: int(x.abs().argmax())],  # a float-derived Python value
    ],
)
def test_value_dependent_code_runs_untraced(fn):
    stage = TracedStage(_Fn(fn), warmup=0)
    for values in ([1.0, -2.0, 3.0], [-1.0, 2.0, -3.0], [-5.0, 1.0, 1.0]):
        x = torch.tensor(values)
        assert torch.equal(_run(stage, x), fn(x))
    assert stage.traced == 0 and stage.disabled is not None


def test_untraceable_stage_and_failed_trace_fall_back():
    stage = TracedStage(torch.nn.Linear(2, 2), warmup=0, untraceable="nondeterministic op(s) r")
    _run(stage, torch.ones(1, 2))
    assert stage.traced == 0 and stage.disabled.startswith("nondeterministic")
    # jit.trace cannot take a dict output: the module runs instead; after 3 failures, for good.
    broken = TracedStage(_Fn(lambda x: {"y": x + 1}), warmup=0)
    for _ in range(3):
        assert broken.disabled is None
        assert torch.equal(_run(broken, torch.ones(2))["y"], torch.full((2,), 2.0))
    assert broken.disabled.startswith("tracing failed")


def test_grad_traces_give_the_modules_gradients():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    stage = TracedStage(net, warmup=1, grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(3):
        got = torch.autograd.grad(stage(x).square().sum(), [x, *net.parameters()])
        want = torch.autograd.grad(net(x).square().sum(), [x, *net.parameters()])
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    _run(stage, x), _run(stage, x)  # no grad: a trace of its own
    assert stage.traced == 2
    plain = TracedStage(net, warmup=0)  # grad=False: grad-mode calls run the module
    plain(x)
    assert plain.traced == 0
