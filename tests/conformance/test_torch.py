"""ONNX's own backend node suite through ``pl.to_torch``: outputs and gradients.

Every case of ``onnx.backend.test.case.node`` (loaded by :mod:`tests.conformance._cases`)
is lowered with :func:`placement.to_torch` on the CPU, run once, and compared with
the suite's expected outputs at the suite's tolerances. Where an output is
floating point and depends on a floating-point input or parameter, a backward
pass must run and give a gradient; on a sample of smooth cases the gradient is
compared with finite differences (``torch.autograd.gradcheck`` in float64).

Cases the lowering does not pass are listed with their reviewed reasons in
``xfail_torch.txt`` and run as strict xfail, so a case that starts passing fails
the run until it is removed (the pass count can only go up)::

    .venv/bin/python -m tests.conformance._cases torch
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import placement as pl
from placement.analysis import NONDETERMINISTIC_OPS
from tests.conformance import _cases

#: Types autograd differentiates (float8 values are data, not differentiated).
_DIFFERENTIABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_tensor = _cases.to_tensor
_numpy = _cases.from_tensor


def _lower(case: _cases.Case) -> torch.nn.Module:
    return pl.to_torch(pl.load(case.model), device_map="cpu")


def run_torch(case: _cases.Case) -> list[np.ndarray]:
    """The case through ``pl.to_torch``: outputs as numpy arrays, after checking a backward pass.

    Floating-point inputs require gradients; when a floating-point output depends
    on an input or parameter, a backward pass must run and reach one of them.
    """
    if not case.tensors_only:
        raise TypeError("sequence, optional or string values: to_torch modules take and return tensors")
    torch.manual_seed(0)  # random ops (Bernoulli) draw the same numbers every run: strict xfails hold
    module = _lower(case)
    args = [_tensor(x) for x in case.inputs]
    for arg in args:
        if arg.dtype in _DIFFERENTIABLE:
            arg.requires_grad_(True)
    got = module(*args)
    got = got if isinstance(got, tuple) else (got,)
    _check_backward(module, args, got)
    return [_numpy(t) for t in got]


def _check_backward(module: torch.nn.Module, args: list[torch.Tensor], got: tuple) -> None:
    leaves = [a for a in args if a.requires_grad] + list(module.parameters())
    heads = [t for t in got if t.dtype in _DIFFERENTIABLE and t.requires_grad]
    if not leaves or not heads:
        return  # nothing differentiable: integer, boolean or constant outputs
    weights = [torch.linspace(0.5, 1.5, t.numel(), dtype=torch.float32).reshape(t.shape) for t in heads]
    loss = sum((t.float() * w).sum() for t, w in zip(heads, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    assert any(g is not None for g in grads), "backward: no input or parameter got a gradient"


_cases.register("torch", run_torch)


@pytest.mark.parametrize("name", _cases.params("torch"))
def test_case(name: str) -> None:
    _cases.run_case(name, "torch")


#: Op types whose outputs are smooth in their floating-point inputs almost everywhere and
#: that compute in their input's precision (LayerNormalization and RMSNormalization compute
#: in their ``stash_type``, float32, which finite differences in float64 cannot check).
_SMOOTH = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Log", "Sqrt", "Tanh", "Sigmoid", "Sin", "Cos", "Erf",
        "Softplus", "Softsign", "Elu", "Celu", "Selu", "Gelu", "Mish", "MatMul", "Gemm", "Einsum",
        "Softmax", "LogSoftmax", "InstanceNormalization", "Conv", "ConvTranspose", "AveragePool",
        "GlobalAveragePool", "ReduceMean",
        "ReduceSum", "ReduceSumSquare", "ReduceLogSumExp", "Attention", "Transpose", "Reshape",
        "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Expand", "Tile", "Pad", "Gather",
        "Identity", "Constant", "Shape", "Size", "Swish", "SwiGLU",
    }
)  # fmt: skip


#: Ops with a kink at zero (Elu with alpha other than 1, Selu): finite differences there
#: average the two one-sided slopes, autograd takes one of them.
_KINKED_AT_ZERO = frozenset({"Elu", "Selu"})


def _at_a_kink(case: _cases.Case) -> bool:
    kinked = any(node.op_type in _KINKED_AT_ZERO for node in case.model.graph.node)
    return kinked and any(np.any(_cases.as_array(x) == 0) for x in case.inputs)


def _smooth_sample(limit: int = 40) -> list[str]:
    listed = _cases.expected_failures("torch")
    names = []
    for name, case in sorted(_cases.cases().items()):
        graph = case.model.graph
        inputs = case.inputs
        if name in listed or not inputs or not case.tensors_only or _at_a_kink(case):
            continue
        if all(node.op_type in _SMOOTH for node in graph.node) and all(
            _cases.as_array(x).dtype in (np.float32, np.float64) for x in inputs
        ):
            names.append(name)
    return names[:: max(1, len(names) // limit)][:limit]


@pytest.mark.parametrize("name", _smooth_sample())
def test_gradients_match_finite_differences(name: str) -> None:
    case = _cases.cases()[name]
    inputs = [_tensor(x).double().requires_grad_(True) for x in case.inputs]
    module = _lower(case).double()

    def first_output(*args: torch.Tensor) -> torch.Tensor:
        out = module(*args)
        return out[0] if isinstance(out, tuple) else out

    assert torch.autograd.gradcheck(
        first_output, tuple(inputs), eps=1e-6, atol=1e-4, rtol=1e-3, fast_mode=True
    )


def test_pass_count_meets_the_bar() -> None:
    """At least 82% of the suite's cases pass (every case not listed as an expected failure):
    1,550 of onnx 1.23's 1,884 cases; older onnx releases generate fewer cases."""
    total = len(_cases.cases())
    assert total - len(_cases.expected_failures("torch")) >= 0.82 * total


#: Ops whose outputs are random by definition (Dropout: with a true ``training_mode``).
_RANDOM_OPS = frozenset(NONDETERMINISTIC_OPS | {"Dropout"})


def _rounding_noise(case: _cases.Case, got: list[np.ndarray]) -> str | None:
    """None when ``got`` equals the expected outputs within four rounding steps of their type
    (relative to the largest expected magnitude), else what differs."""
    for i, (value, want) in enumerate(zip(got, case.outputs)):
        want = np.asarray(_cases.as_array(want))
        if value.shape != want.shape or value.dtype != want.dtype:
            return f"output {i}: {value.dtype}{value.shape}, expected {want.dtype}{want.shape}"
        eps = float(np.finfo(want.dtype).eps) if want.dtype.kind == "f" else 0.0
        scale = float(np.nanmax(np.abs(want))) if want.size else 0.0
        if not np.allclose(value, want, rtol=4 * eps, atol=4 * eps * scale, equal_nan=True):
            return f"output {i} differs by more than rounding noise"
    return None


def test_expected_failures_never_return_wrong_values() -> None:
    """Every listed tensor-only case fails by raising a placement error when lowering.

    The only listed cases allowed to lower are random by definition (their values cannot
    match numpy's generator; their shapes and types must), those within rounding noise
    of the expected values (four steps of the output type), and those where ONNX's
    reference and ONNX Runtime disagree and the lowering returns ONNX Runtime's values.
    Anything else on the list would be a silent wrong answer.
    """
    offenders = []
    for name, reason in sorted(_cases.expected_failures("torch").items()):
        case = _cases.cases()[name]
        if not case.tensors_only:
            continue  # sequences, optionals and strings cannot be a to_torch module's values
        try:
            module = _lower(case)
        except pl.PlacementError:
            continue
        with torch.no_grad():
            got = module(*[_tensor(x) for x in case.inputs])
        got = [_numpy(t) for t in (got if isinstance(got, tuple) else (got,))]
        if {node.op_type for node in case.model.graph.node} & _RANDOM_OPS:
            wants = [np.asarray(_cases.as_array(w)) for w in case.outputs]
            if [(g.shape, g.dtype) for g in got] != [(w.shape, w.dtype) for w in wants]:
                offenders.append(f"{name}: random outputs of the wrong shape or type")
            continue
        if "as later onnx releases' reference" in reason:
            continue  # the expected values predate a fix of the reference; the pinned env checks them
        if "as ONNX Runtime" in reason:  # the reference and ONNX Runtime disagree: follow ORT
            want = _cases.run_ort(case)
            if not all(
                g.shape == w.shape and np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)
            ):
                offenders.append(f"{name}: lowers and returns values other than ONNX Runtime's")
            continue
        problem = _rounding_noise(case, got)
        if problem is not None or "rounding noise" not in reason:
            offenders.append(f"{name}: lowers and returns values ({problem or 'listed for another reason'})")
    assert not offenders, "\n".join(offenders)
