"""``to_torch(chunks=k, executor=...)``: a thread per stage or the caller's thread alone give
the same outputs, losses and gradients bit for bit; ``"auto"`` picks as documented; the
inline executor starts no thread and still hands every micro-batch over with its event."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import placement as pl
from placement.runtime.torch import one_f_one_b, pipelined
from placement.runtime.torch.executor import THREADS_MIN_MACS, choose_executor, input_rows
from tests.runtime.helpers import no_thread_leak, placed_zoo  # noqa: F401 (an autouse fixture)

EXECUTORS = ("threads", "inline")


def _loss(out):
    return out.float().square().mean()


def _modules(name, **options):
    model, _, args = placed_zoo(name)
    modules = {ex: pl.to_torch(model, device_map="cpu", chunks=3, executor=ex, **options) for ex in EXECUTORS}
    state = modules["threads"].state_dict()
    modules["inline"].load_state_dict(state)
    return modules, args


def _grads(module):
    return [p.grad for p in module.parameters()]


def _assert_equal(a, b):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_train_step_executors_agree_bit_for_bit(name):
    modules, args = _modules(name, checkpoint="except_last")
    losses, grads = {}, {}
    for ex, module in modules.items():
        losses[ex] = module.train_step(*args, loss_fn=_loss, defer_weights=True)
        module.train_step(*args, loss_fn=_loss, defer_weights=False)  # added to the first
        grads[ex] = _grads(module)
        assert module.stats.executor == ex
    assert torch.equal(losses["threads"], losses["inline"])
    _assert_equal(grads["threads"], grads["inline"])


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_gpipe_and_inference_executors_agree_bit_for_bit(name):
    modules, args = _modules(name, checkpoint="always")
    outs, grads = {}, {}
    for ex, module in modules.items():
        with torch.no_grad():
            outs[ex] = module(*args)
        assert module.stats.executor == ex
        _loss(module(*args)).backward()
        assert module.stats.executor == ex and module.stats.total_recomputed > 0
        grads[ex] = _grads(module)
    assert torch.equal(outs["threads"], outs["inline"])
    _assert_equal(grads["threads"], grads["inline"])


def test_inline_starts_no_thread(monkeypatch):
    modules, (x,) = _modules("mlp")
    started = []
    original = threading.Thread.start

    def start(self):
        started.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    inline = modules["inline"]
    inline.train_step(x, loss_fn=_loss)
    _loss(inline(x)).backward()
    with torch.no_grad():
        inline(x)
    assert started == []
    modules["threads"].train_step(x, loss_fn=_loss)
    assert started == ["placement-train-stage-0"]


def test_auto_picks_inline_for_tiny_host_stages_and_threads_for_big_ones():
    model, _, (x,) = placed_zoo("mlp")
    module = pl.to_torch(model, device_map="cpu", chunks=3)
    assert module.executor == "auto"
    module.train_step(x, loss_fn=_loss)
    assert module.stats.executor == "inline"  # a tiny MLP: hand-offs would cost more than they free
    big = [("cpu", THREADS_MIN_MACS), ("cpu", 1)]
    assert choose_executor("auto", big, rows=1, cores=2) == "threads"
    assert choose_executor("auto", big, rows=1, cores=1) == "inline"  # one core: nothing overlaps
    assert choose_executor("auto", [("cpu", THREADS_MIN_MACS - 1)] * 2, rows=1, cores=2) == "inline"
    assert choose_executor("auto", [("cuda", THREADS_MIN_MACS)] * 2, rows=8, cores=2) == "inline"
    assert choose_executor("auto", [("cpu", THREADS_MIN_MACS), ("cuda", 1)], rows=8, cores=2) == "inline"
    assert choose_executor("inline", big, rows=8, cores=2) == "inline"
    assert input_rows([torch.zeros(10, 3, 4)], 3) == 10  # 30 rows of 4 features, cut 3 ways
    assert input_rows([torch.zeros(6, 5, dtype=torch.long)], 2) == 15  # token ids: a row each


def test_auto_picks_threads_for_a_wide_model_on_the_cpu():
    """Two host stages of 512 x 512 weights on 256-row micro-batches reach the threshold."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
    x = torch.randn(512, 512)
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    model.set_device(model.ops[-1].name, 1)
    module = pl.to_torch(model, device_map="cpu", chunks=2)
    with torch.no_grad():
        module(x)
    expected = "threads" if (os.cpu_count() or 1) > 1 else "inline"  # one core: nothing overlaps
    assert 256 * (512 * 512 + 512) >= THREADS_MIN_MACS > 64 * (512 * 512 + 512)
    assert module.stats.executor == expected


def test_executor_is_checked_and_settable():
    model = placed_zoo("mlp")[0]
    with pytest.raises(ValueError, match="executor must be one of auto, threads, inline"):
        pl.to_torch(model, device_map="cpu", chunks=2, executor="processes")
    module = pl.to_torch(model, device_map="cpu", chunks=2, executor="threads")
    module.executor = "inline"
    module.train_step(placed_zoo("mlp")[2][0], loss_fn=_loss)
    assert module.stats.executor == "inline"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_inline_and_threads_name_the_failing_stage(executor):
    model, _, (idx,) = placed_zoo("gpt")
    module = pl.to_torch(model, device_map="cpu", chunks=3, executor=executor)
    bad = idx.clone()
    bad[4, 0] = 10_000  # the embedding lookup of micro-batch 2 fails
    with pytest.raises(pl.PipelineError, match="stage 0 .* failed on micro-batch 2"):
        module.train_step(bad, loss_fn=lambda out: out.float().mean())
    with pytest.raises(pl.PipelineError, match="stage 0 .* failed on micro-batch 2"):
        module(bad)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("executor", EXECUTORS)
def test_every_hand_over_carries_its_producers_event(monkeypatch, executor):
    """The GPU code path on the CPU: ``signal`` records an event in every environment a stage
    hands on (an emulated one here), and the stage that reads it waits for exactly that one."""
    recorded, waited = [], []

    def signal(env, device):
        event = object()
        recorded.append(event)
        env["__event__"] = event

    def wait_for(env, *devices):
        event = env.pop("__event__", None)
        if event is not None:
            waited.append(event)

    for module in (one_f_one_b, pipelined):
        monkeypatch.setattr(module, "signal", signal)
        monkeypatch.setattr(module, "wait_for_stage", wait_for)
    monkeypatch.setattr(pipelined, "wait_for", wait_for)  # the join's
    model, _, (x,) = placed_zoo("mlp")
    piped = pl.to_torch(model, device_map="cpu", chunks=3, executor=executor)
    piped.train_step(x, loss_fn=_loss)
    # stage 0 hands 3 forwards on, stage 1 hands 3 input gradients back; stage 0's own
    # backward signals too (its gradients are read by the caller's stream)
    assert set(waited) <= set(recorded) and len(waited) == 6 and len(recorded) == 9
    recorded.clear(), waited.clear()
    _loss(piped(x)).backward()
    assert set(waited) <= set(recorded) and len(waited) == len(recorded) == 12


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_gpu_stages_agree_across_executors(name):
    """Two stages on ``cuda:0``, each on its own stream: inline (auto's choice) and threads."""
    model, _, args = placed_zoo(name)
    args = [a.cuda() for a in args]
    modules = {ex: pl.to_torch(model, device_map={0: "cuda:0", 1: "cuda:0"}, chunks=3, executor=ex)
               for ex in ("auto", "threads")}  # fmt: skip
    modules["auto"].load_state_dict(modules["threads"].state_dict())
    losses, grads = {}, {}
    for ex, module in modules.items():
        losses[ex] = module.train_step(*args, loss_fn=_loss)
        _loss(module(*args)).backward()
        grads[ex] = _grads(module)
    torch.cuda.synchronize()
    assert modules["auto"].stats.executor == "inline"
    assert torch.equal(losses["auto"], losses["threads"])
    _assert_equal(grads["auto"], grads["threads"])
