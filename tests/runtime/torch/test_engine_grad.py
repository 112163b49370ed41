"""Tests for ``engine_grad``: torch's private ``_engine_run_backward`` is called positionally
only while its signature (and a probe) say it takes that call; a changed one falls back to
``torch.autograd.grad`` with the same gradients."""

from __future__ import annotations

import pytest
import torch

from placement.runtime.torch import engine_grad as eg


def _graph():
    w = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    x = torch.randn(5, 3)
    y = torch.tanh(x @ w + b)
    seed = torch.randn(5, 4)
    return y, [w, b, unused], seed


def _reference():
    torch.manual_seed(0)
    y, inputs, seed = _graph()
    return torch.autograd.grad([y], inputs, [seed], allow_unused=True)


def _ours():
    torch.manual_seed(0)
    y, inputs, seed = _graph()
    return eg.engine_grad([y], inputs, [seed])


def _same(got, want):
    assert len(got) == len(want)
    for g, r in zip(got, want):
        assert (g is None) == (r is None)
        if r is not None:
            assert torch.equal(g, r)


@pytest.fixture(autouse=True)
def _fresh_check(monkeypatch):
    monkeypatch.setattr(eg, "_checked", (object(), None))  # each test checks anew


def test_the_installed_torch_takes_the_fast_path():
    real = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if real is None:
        pytest.skip("this torch has no torch.autograd.graph._engine_run_backward")
    assert eg.engine_run() is real
    _same(_ours(), _reference())


def _changed(t_outputs, inputs, grad_tensors, keep_graph=False, create_graph=False, allow_unreachable=True):
    raise AssertionError("called with the old argument order")


def _renamed(t_outputs, grads, retain, create, inputs, allow_unreachable, accumulate_grad):
    raise AssertionError("called although its parameters have other names")


@pytest.mark.parametrize("replacement", [_changed, _renamed], ids=["reordered", "renamed"])
def test_a_changed_signature_falls_back_to_autograd_grad(monkeypatch, replacement):
    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", replacement, raising=False)
    assert eg.engine_run() is None
    _same(_ours(), _reference())  # the replacement was never called: it raises


def test_a_matching_signature_that_misbehaves_is_refused_by_the_probe(monkeypatch):
    real = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if real is None:
        pytest.skip("this torch has no torch.autograd.graph._engine_run_backward")

    def swapped(t_outputs, *args, **kwargs):  # same shape, but reads its arguments differently
        grads, keep, create, inputs, *rest = args
        return real(t_outputs, tuple(2 * g for g in grads), keep, create, inputs, *rest, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", swapped)
    assert eg.engine_run() is None
    _same(_ours(), _reference())


def test_a_missing_function_falls_back(monkeypatch):
    monkeypatch.delattr(torch.autograd.graph, "_engine_run_backward", raising=False)
    assert eg.engine_run() is None
    _same(_ours(), _reference())
