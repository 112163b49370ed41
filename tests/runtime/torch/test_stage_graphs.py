"""CUDA graphs per pipeline stage (``to_torch(chunks=k, cuda_graphs=True)``): the capture logic
through its seams on the CPU (fallback, one notice, a cache per shape, equal outputs and
gradients), graphs equal to eager on a GPU; and the recomputation counts of ``module.stats``."""

from __future__ import annotations

import functools
import warnings
from collections import Counter

import pytest
import torch

import placement as pl
from placement.runtime.torch.stage_graphs import GraphedStageCall, graph_stages
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)


@functools.cache
def _placed(name: str = "mlp"):
    from placement import models

    net, args = models.build(name, "tiny")
    model = pl.from_torch(net, args, dynamic_shapes=tuple({0: torch.export.Dim("batch")} for _ in args))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    return model, args


def _loss(out):
    return out.float().square().mean()


def _reference_grads(model, args):
    plain = pl.to_torch(model, device_map="cpu")
    loss = _loss(plain(*args))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in plain.named_parameters()}


class _Seams:
    """Capture seams that record what was captured; ``fail`` makes every capture raise."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.captured: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def _record(self, kind, fn, args):
        if self.fail:
            raise RuntimeError(f"capture not allowed ({kind})")
        self.captured.append((kind, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return lambda *new: fn(*new)  # a "graph" that replays by running the stage

    def forward(self, fn, args, device, fixed):
        return self._record("forward", fn, args)

    def training(self, fn, args, device, fixed):
        return self._record("training", fn, args)


def _graphed(seams: _Seams, **kwargs):
    model, args = _placed()
    module = pl.to_torch(model, device_map="cpu", chunks=2, **kwargs)
    wrapped = graph_stages(
        module._pl_stages, capture_forward=seams.forward, capture_training=seams.training, require_gpu=False
    )
    assert len(wrapped) == 2
    return module, args


def test_a_failed_capture_falls_back_to_eager_with_one_notice_per_stage():
    module, (x,) = _graphed(_Seams(fail=True))
    model, _ = _placed()
    eager = pl.to_torch(model, device_map="cpu")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for batch in (x, x, x[:2], x[:2]):  # two micro-batch shapes, each seen twice
            torch.testing.assert_close(module(batch), eager(batch))
    notices = [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
    assert len(notices) == 2, notices  # once per stage, not once per call or shape
    assert all("capture not allowed" in n and "runs eagerly" in n for n in notices)
    calls = [s.call for s in module._pl_stages]
    assert all(isinstance(c, GraphedStageCall) for c in calls)
    assert [c.fallbacks for c in calls] == [2, 2]  # one failed capture per shape, then eager
    assert [c.captures for c in calls] == [0, 0]


def test_graphs_are_captured_once_per_shape_and_reused_across_steps():
    seams = _Seams()
    module, (x,) = _graphed(seams, checkpoint="always")
    model, _ = _placed()
    eager = pl.to_torch(model, device_map="cpu")

    def kinds():
        return Counter(kind for kind, _ in seams.captured)

    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(module(x), eager(x))
    assert kinds() == {"forward": 2}  # each stage's forward, once for three calls of two micro-batches
    assert [s.call.replays for s in module._pl_stages] == [6, 6]
    want_loss, want = _reference_grads(model, (x,))
    for _ in range(2):
        module.zero_grad()
        loss = module.train_step(x, loss_fn=_loss)
        torch.testing.assert_close(loss, want_loss)
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6)
        # stage 0's checkpointed forward replays the inference graph (same signature); its
        # recompute and the last stage's forward are captured with their backward, once
        assert kinds() == {"forward": 2, "training": 2}
    module.zero_grad()
    module.train_step(x[:2], loss_fn=_loss)  # a new micro-batch shape: captured again
    assert kinds() == {"forward": 3, "training": 4}


def test_gpipe_backward_through_graphed_stages_equals_the_unsplit_gradients():
    module, (x,) = _graphed(_Seams(), checkpoint="except_last")
    model, _ = _placed()
    want_loss, want = _reference_grads(model, (x,))
    loss = _loss(module(x))
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6)


def test_without_a_gpu_stage_the_module_says_so_and_runs_eagerly():
    model, (x,) = _placed()
    with pytest.warns(UserWarning, match="no stage runs on a GPU"):
        module = pl.to_torch(model, device_map="cpu", chunks=2, cuda_graphs=True)
    assert not any(isinstance(s.call, GraphedStageCall) for s in module._pl_stages)
    with torch.no_grad():
        torch.testing.assert_close(module(x), pl.to_torch(model, device_map="cpu")(x))


@pytest.mark.parametrize(
    ("checkpoint", "train_step", "gpipe"),
    [("always", [4, 0], [4, 4]), ("except_last", [3, 0], [3, 3]), ("never", [0, 0], [0, 0])],
)
def test_stats_count_the_recomputed_forwards(checkpoint, train_step, gpipe):
    model, (x,) = _placed()
    x = torch.cat([x, x])  # 8 rows: 4 micro-batches of 2
    module = pl.to_torch(model, device_map="cpu", chunks=4, checkpoint=checkpoint)
    module.train_step(x, loss_fn=_loss)
    assert module.stats.microbatches == 4
    assert module.stats.recomputed == train_step  # the last stage's backward follows its forward
    _loss(module(x)).backward()
    assert module.stats.recomputed == gpipe and module.stats.total_recomputed == sum(gpipe)


@pytest.mark.gpu
def test_pipelined_graphs_equal_eager_on_a_gpu():
    model, (x,) = _placed()
    devices = {0: "cuda:0", 1: "cuda:0"}
    eager = pl.to_torch(model, device_map=devices, chunks=2)
    graphed = pl.to_torch(model, device_map=devices, chunks=2, cuda_graphs=True)
    x = x.cuda()
    with torch.no_grad():
        want = eager(x)
        first, second = graphed(x), graphed(x)
    calls = [s.call for s in graphed._pl_stages]
    assert [c.captures for c in calls] == [1, 1] and [c.replays for c in calls] == [4, 4]
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)  # TF32 off by default for matmuls
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)
    losses = {}
    for module in (eager, graphed):
        for _ in range(2):  # the second step replays the graphs the first captured
            module.zero_grad()
            losses[module] = module.train_step(x, loss_fn=_loss)
    torch.testing.assert_close(losses[graphed], losses[eager])
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
