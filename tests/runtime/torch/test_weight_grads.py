"""Input gradients now, weight gradients later: the two parts add up to one backward."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from placement.runtime.torch.weight_grads import backward_inputs


def _split_equals_full(fn, inputs, params):
    """Run ``fn``'s backward in two parts and in one; return how many groups were deferred."""
    torch.manual_seed(1)
    outs = fn(*inputs, *params)
    seeds = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, [*inputs, *params], seeds, allow_unused=True, retain_graph=True)
    dx, now, later = backward_inputs(outs, seeds, inputs, params)
    deferred = len(later)
    got = list(now)
    for p, g in later.run_all():
        assert got[p] is None, "a parameter's gradient came in both parts"
        got[p] = g
    for a, b in zip([*dx, *got], want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    return deferred


def _tensors():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w, v = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    return [x], [w, b, v]


CASES = {
    # every parameter meets the input path at its own op: three groups, nothing now
    "mlp": (lambda x, w, b, v: [torch.relu(x @ w + b) @ v], 3),
    # w read twice (tied): one group with two merge nodes, a path between them
    "tied": (lambda x, w, b, v: [torch.relu(x @ w + b) @ w.t()], 2),
    # an output computed from a parameter alone: v's gradient comes now
    "parameter-only output": (lambda x, w, b, v: [x @ w, (v * 2).sum(0)], 1),
    # v reaches an output both through the input path and directly: now
    "direct and merged": (lambda x, w, b, v: [x @ w + v.sum(), v.mean()], 1),
    # the inputs need no gradient: nothing to merge with, all now
    "no input path": (lambda x, w, b, v: [x.detach() @ w + b], 0),
    "layer norm": (lambda x, w, b, v: [torch.nn.functional.layer_norm(x @ v, (4,), w[0], b)], 2),
    # two parameters combined before they meet the input: one group
    "combined": (lambda x, w, b, v: [x @ (w + v) + b], 2),
}


@pytest.mark.parametrize("case", CASES)
def test_two_parts_add_up_to_one_backward(case):
    fn, groups = CASES[case]
    inputs, params = _tensors()
    assert _split_equals_full(fn, inputs, params) == groups


class _MatMuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def test_input_pass_computes_no_weight_gradient():
    """The first part runs one matrix product (dx), the second the other (dW): that is the point."""
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    out = x @ w
    seed = torch.ones_like(out)
    with _MatMuls() as first:
        dx, now, later = backward_inputs([out], [seed], [x], [w])
    assert first.count == 1 and now == [None] and len(later) == 1 and w.grad is None
    torch.testing.assert_close(dx[0], seed @ w.t())
    with _MatMuls() as second:
        ((_, dw),) = list(later.run_all())
    assert second.count == 1
    torch.testing.assert_close(dw, x.t() @ seed)


def test_groups_run_on_other_threads_at_once():
    inputs, params = _tensors()
    out = torch.tanh(torch.relu(inputs[0] @ params[0] + params[1]) @ params[2])
    seed = torch.ones_like(out)
    want = torch.autograd.grad([out], params, [seed], retain_graph=True)
    _, _, later = backward_inputs([out], [seed], inputs, params)
    groups = [later.take() for _ in range(len(later))]
    results: dict[int, torch.Tensor] = {}

    def run(group):
        results.update(later.run(group))

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, g in enumerate(want):
        torch.testing.assert_close(results[p], g)
