"""``PipelinedModule.train_step``: 1F1B with deferred weight gradients gives the unsplit step's
loss and gradients, on every zoo model, whatever the timing; errors name stage and micro-batch."""

from __future__ import annotations

import functools
import json
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement as pl
from placement.runtime.torch.train_step import train_step
from tests.conftest import MODEL_NAMES


@pytest.fixture(autouse=True)
def no_thread_leak():
    yield
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.name.startswith("placement-train")]
        if not extra:
            return
        time.sleep(0.01)
    raise AssertionError(f"train_step threads left running: {extra}")


@functools.cache
def _placed(name: str, devices: int = 2):
    from placement import models

    net, args = models.build(name, "tiny")
    batch = torch.export.Dim("batch")
    model = pl.from_torch(net, args, dynamic_shapes=tuple({0: batch} for _ in args))
    acts = pl.get_activation_blobs(model)
    for d in range(1, devices):
        pl.shift_activation_devices(model, acts[len(acts) * d // devices :], {d - 1: d})
    pl.inject_cross_device_copies(model)
    big = tuple(torch.cat([a, a.flip(0), a, a.flip(0), a])[:5] for a in args)  # 5: not a multiple of 3
    return model, big


def _loss(out, target):
    return torch.nn.functional.mse_loss(out.float(), target)


def _reference(model, args, target, loss_fn=_loss):
    plain = pl.to_torch(model, device_map="cpu")
    loss = loss_fn(plain(*args), target)
    loss.backward()
    return plain, loss.detach()


def _assert_same_grads(module, plain, atol=1e-5, rtol=1e-4):
    want = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys() and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=rtol)


def _target(model, args):
    with torch.no_grad():
        out = pl.to_torch(model, device_map="cpu")(*args)
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_train_step_equals_the_unsplit_step(name, defer):
    model, args = _placed(name)
    target = _target(model, args)
    plain, want = _reference(model, args, target)
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    piped.load_state_dict(plain.state_dict())
    assert len(piped.stages) == 2
    loss = piped.train_step(*args, loss_fn=_loss, targets=(target,), defer_weights=defer)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    assert not loss.requires_grad
    _assert_same_grads(piped, plain)


@pytest.mark.parametrize("max_in_flight", [None, 1])
def test_three_stages_and_bounded_activations(max_in_flight):
    """A middle stage defers its weight gradients; any idle worker may run them."""
    model, (idx,) = _placed("gpt", devices=3)
    target = _target(model, (idx,))
    plain, want = _reference(model, (idx,), target)
    piped = pl.to_torch(model, device_map="cpu", chunks=4)
    assert len(piped.stages) == 3
    loss = piped.train_step(
        idx, loss_fn=_loss, targets=(target,), max_in_flight=max_in_flight, defer_weights=True
    )
    assert piped.stats.deferred > 0
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    _assert_same_grads(piped, plain)


def test_auto_defers_only_weight_gradients_big_enough_to_pay():
    """``defer_weights="auto"`` (the default) leaves a tiny stage's weight gradients in its
    backward and defers those of a stage whose micro-batch makes them big."""
    from placement.runtime.torch.one_f_one_b import DEFER_MIN_MACS, defer_pays

    torch.manual_seed(0)
    width = 256
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
    x = torch.randn(8, width)
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    model.set_device(model.ops[-1].name, 1)
    pl.inject_cross_device_copies(model)
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    small, big = x[:4], x.repeat(4, 1)  # micro-batches of 2 and 16 rows; the last stage has 65792 weights
    assert not defer_pays([small[:2]], [net[2].weight, net[2].bias])
    assert 16 * (width * width + width) >= DEFER_MIN_MACS
    piped.train_step(small, loss_fn=_loss_sq)
    assert piped.stats.deferred == 0
    piped.train_step(big, loss_fn=_loss_sq)
    assert piped.stats.deferred == 2  # the last stage's Linear, for each micro-batch
    piped.train_step(small, loss_fn=_loss_sq, defer_weights=True)
    assert piped.stats.deferred == 2
    piped.train_step(big, loss_fn=_loss_sq, defer_weights=False)
    assert piped.stats.deferred == 0


def _loss_sq(out):
    return out.square().mean()


def test_gradients_do_not_depend_on_timing():
    """Micro-batch gradients are summed in micro-batch order whoever ran them: bit for bit."""
    model, (idx,) = _placed("gpt", devices=3)
    target = _target(model, (idx,))
    piped = pl.to_torch(model, device_map="cpu", chunks=5)
    runs = []
    for _ in range(4):
        piped.zero_grad(set_to_none=True)
        piped.train_step(idx, loss_fn=_loss, targets=(target,), defer_weights=True)
        runs.append([p.grad.clone() for p in piped.parameters()])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def test_gradients_accumulate_and_sum_reduction():
    model, (x,) = _placed("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    plain = pl.to_torch(model, device_map="cpu")

    def loss_fn(out):
        return out.square().sum()

    for _ in range(2):  # .grad accumulates, as loss.backward() does
        loss_fn(plain(x)).backward()
        total = piped.train_step(x, loss_fn=loss_fn, reduction="sum")
    torch.testing.assert_close(total, loss_fn(plain(x)).detach(), atol=1e-5, rtol=1e-5)
    _assert_same_grads(piped, plain, atol=1e-4)


def test_checkpointed_micro_batches_recompute():
    model, (x,) = _placed("resnet")
    target = _target(model, (x,))
    plain, want = _reference(model, (x,), target)
    piped = pl.to_torch(model, device_map="cpu", chunks=3, checkpoint="always")
    loss = piped.train_step(x, loss_fn=_loss, targets=(target,))
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    _assert_same_grads(piped, plain)


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(torch.relu(h))


def test_outputs_of_an_earlier_stage_take_the_loss_gradient():
    """One output is made by the first stage: its share of the loss gradient goes back there."""
    torch.manual_seed(0)
    net, x = _TwoHeads(), torch.randn(6, 4)
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    last = [op.name for op in model.ops][-1]
    model.set_device(last, 1)
    pl.inject_cross_device_copies(model)

    def loss_fn(out):
        h, y = out
        return h.square().mean() + y.sin().mean()

    plain = pl.to_torch(model, device_map="cpu")
    want = loss_fn(plain(x))
    want.backward()
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    assert len(piped.stages) == 2
    loss = piped.train_step(x, loss_fn=loss_fn)
    torch.testing.assert_close(loss, want.detach())
    _assert_same_grads(piped, plain)


def test_stage_error_names_stage_and_microbatch():
    model, (idx,) = _placed("gpt")
    piped = pl.to_torch(model, device_map="cpu", chunks=3)
    bad = idx.clone()
    bad[4, 0] = 10_000  # the embedding lookup of micro-batch 2 fails
    with pytest.raises(pl.PipelineError, match="stage 0 .* failed on micro-batch 2") as info:
        piped.train_step(bad, loss_fn=lambda out: out.mean())
    assert info.value.stage == 0 and info.value.microbatch == 2
    assert all(p.grad is None for p in piped.parameters())  # nothing written


def test_loss_errors_name_the_last_stage():
    model, (x,) = _placed("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    scalar = "stage 1 .*micro-batch 0: TypeError: loss_fn must return a scalar"
    with pytest.raises(pl.PipelineError, match=scalar):
        piped.train_step(x, loss_fn=lambda out: out)
    with pytest.raises(pl.PipelineError, match="micro-batch 0: ZeroDivisionError"):
        piped.train_step(x, loss_fn=lambda out: 1 / 0)


def test_bad_arguments():
    model, (x,) = _placed("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=2)
    with pytest.raises(pl.InputError, match="target 0 must have the batch \\(5\\)"):
        piped.train_step(x, loss_fn=_loss, targets=(torch.zeros(4, 3),))
    with pytest.raises(ValueError, match="reduction"):
        piped.train_step(x, loss_fn=_loss, reduction="max")
    with pytest.raises(ValueError, match="defer_weights"):
        piped.train_step(x, loss_fn=_loss, defer_weights="sometimes")
    with pytest.raises(ValueError, match="max_in_flight"):
        piped.train_step(x, loss_fn=_loss, max_in_flight=0)
    with pytest.raises(TypeError, match="missing input"):
        piped.train_step(loss_fn=_loss)


def test_function_form_matches_the_method_and_takes_any_module():
    model, (x,) = _placed("mlp")
    a = pl.to_torch(model, device_map="cpu", chunks=2)
    b = pl.to_torch(model, device_map="cpu", chunks=2)
    la = a.train_step(x, loss_fn=lambda out: out.mean())
    lb = pl.train_step(b, x, loss_fn=lambda out: out.mean())
    assert torch.equal(la, lb) and train_step is pl.train_step
    plain = pl.to_torch(model, device_map="cpu")  # chunks=1: the plain module, one backward
    lp = pl.train_step(plain, x, loss_fn=lambda out: out.mean())
    torch.testing.assert_close(lp, la)
    _assert_same_grads(a, plain)
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got \\(5, 8\\)"):
        pl.train_step(plain, x, loss_fn=lambda out: out)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 7),
    chunks=st.integers(2, 5),  # chunks=1 lowers to the plain module
    devices=st.integers(1, 3),
    defer=st.booleans(),
    max_in_flight=st.one_of(st.none(), st.integers(1, 3)),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_any_split_gives_the_unsplit_gradients(batch, chunks, devices, defer, max_in_flight, reduction):
    """Whatever the batch, chunk count, stage count, deferral, in-flight bound and reduction."""
    model, (x,) = _placed("mlp", devices=devices)
    x = torch.cat([x, x.flip(0)])[:batch]
    plain = pl.to_torch(model, device_map="cpu")

    def loss_fn(out):
        per_sample = out.square().sum(-1).sin()
        return per_sample.mean() if reduction == "mean" else per_sample.sum()

    want = loss_fn(plain(x))
    want.backward()
    piped = pl.to_torch(model, device_map="cpu", chunks=chunks)
    loss = piped.train_step(
        x, loss_fn=loss_fn, reduction=reduction, defer_weights=defer, max_in_flight=max_in_flight
    )
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    _assert_same_grads(piped, plain, atol=1e-4, rtol=1e-3)  # sums in another order: float32 rounding


@pytest.mark.slow  # a fresh process per contender
def test_training_memory_benchmark_runs(tmp_path, capsys):
    """``benchmarks/training_memory.py`` on tiny GPT: a row per contender, from fresh processes.
    Two contenders, the eager module and the placed ``train_step`` (the placed GPipe and bounded
    steps are the same code path with other options, tested above in process)."""
    from benchmarks import training_memory

    out = tmp_path / "memory.json"
    argv = ["--models", "gpt", "--size", "tiny", "--contenders", "eager", "train_step", "--out", str(out)]
    assert training_memory.main(argv) == 0
    assert "train_step" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["contender"] for r in rows] == ["eager", "train_step"]
    assert all(r["base_mib"] > 50 and r["peak_mib"] >= r["base_mib"] for r in rows)
