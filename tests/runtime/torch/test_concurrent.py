"""Stages that do not depend on each other run at once in the torch runtime
(``placement/runtime/torch/concurrent.py``): the per-device branches of a tensor-parallel split,
forward, backward and ``train_step``, with the unsplit model's outputs and gradients."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import placement as pl
from placement.errors import InputError, PipelineError
from placement.models import gpt, mlp
from placement.runtime.schedule import stage_threads
from placement.runtime.schedule.dag import graph_width
from placement.runtime.stages import partition
from placement.runtime.torch.concurrent import (
    concurrent_pays,
    per_thread_budgets,
    stage_dependences,
)
from placement.runtime.torch.pipelined import PipelinedModule
from tests.runtime.helpers import no_thread_leak  # noqa: F401 (an autouse fixture)

TOL = {"rtol": 1e-5, "atol": 1e-5}
CPUS = {0: "cpu", 1: "cpu"}


def _split(net: nn.Module, x: torch.Tensor, *, dynamic: bool = True) -> pl.Model:
    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    model = pl.from_torch(net, (x,), dynamic_shapes=shapes)
    pl.split_tensor_parallel(model, devices=[0, 1])
    return model


@pytest.fixture(scope="module")
def tiny_gpt() -> tuple[nn.Module, torch.Tensor, pl.Model]:
    net, (idx,) = gpt.build("tiny")
    idx = torch.cat([idx, idx.flip(0)], 0)  # two sequences: two micro-batches
    return net, idx, _split(net, idx)


def _shard_grads_match(net: nn.Module, lowered: nn.Module) -> int:
    """Each lowered parameter's gradient equals the unsplit one at the elements it holds (a
    shard's rows or columns are found by value in the whole weight); returns how many shards."""
    whole = dict(net.named_parameters(remove_duplicate=False))
    params = dict(lowered.named_parameters())
    shards = 0
    for init, path in lowered.initializer_paths.items():
        p, base = params.get(path), init.split(".tp")[0]
        if p is None or base not in whole:
            continue
        assert p.grad is not None, init
        full = whole[base]
        if p.shape == full.shape:
            torch.testing.assert_close(p.grad, full.grad, **TOL)
            continue
        shards += 1
        (axis,) = [a for a in range(p.dim()) if p.shape[a] != full.shape[a]]
        rows = [full.detach().select(axis, j) for j in range(full.shape[axis])]
        index = [
            next(j for j, r in enumerate(rows) if torch.equal(r, p.detach().select(axis, i)))
            for i in range(p.shape[axis])
        ]
        torch.testing.assert_close(p.grad, full.grad.index_select(axis, torch.tensor(index)), **TOL)
    return shards


@pytest.mark.parametrize("chunks", [1, 2])
def test_split_gpt_runs_its_branches_at_once_with_the_unsplit_outputs_and_gradients(tiny_gpt, chunks):
    net, idx, model = tiny_gpt
    module = pl.to_torch(model, device_map=CPUS, chunks=chunks, concurrent=True)
    assert isinstance(module, PipelinedModule)
    out = module(idx)
    assert module.stats.concurrent == 2 and module.stats.executor == "threads"
    assert len(module.stats.timeline) == len(module.stages) * chunks
    net.zero_grad()
    expected = net(idx)
    torch.testing.assert_close(out, expected, **TOL)
    expected.square().mean().backward()
    out.square().mean().backward()
    assert _shard_grads_match(net, module) >= 8  # 2 blocks' attention and MLP, the embedding


def test_split_gpt_train_step_runs_the_dag_with_the_unsplit_loss_and_gradients(tiny_gpt):
    net, idx, model = tiny_gpt
    module = pl.to_torch(model, device_map=CPUS, chunks=2, concurrent=True)
    loss = module.train_step(idx, loss_fn=lambda out: out.square().mean())
    assert module.stats.concurrent == 2
    net.zero_grad()
    expected = net(idx).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    assert _shard_grads_match(net, module) >= 8


def test_zoo_mlp_forward_backward_and_train_step_equal_the_unsplit_module():
    net, (x,) = mlp.build("tiny")
    model = _split(net, x)
    module = pl.to_torch(model, device_map=CPUS, concurrent=True)
    with torch.no_grad():
        torch.testing.assert_close(module(x), net(x), **TOL)
    net.zero_grad()
    net(x).square().sum().backward()
    module(x).square().sum().backward()
    assert module.stats.concurrent == 2
    assert _shard_grads_match(net, module) >= 2
    for p in module.parameters():
        p.grad = None
    module.train_step(x, loss_fn=lambda out: out.square().sum(), reduction="sum")
    assert _shard_grads_match(net, module) >= 2


def test_concurrent_and_chained_runs_give_the_same_gradients_bit_for_bit(tiny_gpt):
    """One intra-op thread everywhere (kernels then round alike): the DAG adds each gradient's
    parts in the chain's order."""
    _, idx, model = tiny_gpt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads = {}
        for concurrent in (True, False):
            module = pl.to_torch(model, device_map=CPUS, chunks=2, executor="threads", concurrent=concurrent)
            module(idx).square().mean().backward()
            assert module.stats.concurrent == (2 if concurrent else 0)
            grads[concurrent] = {name: p.grad for name, p in module.named_parameters()}
    finally:
        torch.set_num_threads(threads)
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[True])


def _barrier_on_first_branches(module: PipelinedModule, seen: dict[int, int]) -> threading.Barrier:
    """Make the stages that read no other stage (the first layer's branches) wait for each
    other inside their call: only stages running at once get through."""
    deps = stage_dependences(module._pl_stages)
    first = [s for s, d in zip(module._pl_stages, deps) if not d]
    assert len(first) == 2
    barrier = threading.Barrier(len(first), timeout=3)

    class Waiting:
        def __init__(self, call, index):
            self.call, self.index = call, index

        def __getattr__(self, name):
            return getattr(self.call, name)

        def __call__(self, *args):
            seen[self.index] = torch.get_num_threads()
            barrier.wait()
            return self.call(*args)

    for stage in first:
        stage.call = Waiting(stage.call, stage.index)
    return barrier


@pytest.mark.parametrize("step", ["forward", "train_step"])
def test_the_branches_overlap_and_a_chain_would_not(step):
    """The branch stages of the first split layer meet at a barrier inside their calls: the
    concurrent run gets through (their intervals intersect); the chained run of the same
    module breaks the barrier, since one branch waits there alone."""
    net, (x,) = mlp.build("tiny")
    x = torch.cat([x, x], 0)
    module = pl.to_torch(_split(net, x), device_map=CPUS, chunks=2, concurrent=True)
    seen: dict[int, int] = {}
    _barrier_on_first_branches(module, seen)
    caller_threads = torch.get_num_threads()

    def run() -> None:
        if step == "forward":
            with torch.no_grad():
                module(x)
        else:
            module.train_step(x, loss_fn=lambda out: out.square().mean())

    run()
    assert torch.get_num_threads() == caller_threads  # the workers' budgets do not leak
    if per_thread_budgets():
        assert set(seen.values()) == {stage_threads(2)}  # each branch its share of the cores
    if step == "forward":
        runs = {(r.stage, r.microbatch): r for r in module.stats.timeline}
        first = sorted(seen)
        for i in range(2):
            a, b = runs[first[0], i], runs[first[1], i]
            assert a.start < b.end and b.start < a.end and a.thread != b.thread
    module.concurrent = False
    module.executor = "threads"
    with pytest.raises(PipelineError) as caught:
        run()
    assert isinstance(caught.value.__cause__, threading.BrokenBarrierError)


def test_concurrent_defaults_on_only_where_it_pays():
    net, (x,) = mlp.build("tiny")
    model = _split(net, x, dynamic=False)
    assert graph_width([s.depends_on for s in partition(model)]) == 2
    # tiny stages: the default keeps one GraphModule; True makes the DAG
    assert not isinstance(pl.to_torch(model, device_map=CPUS), PipelinedModule)
    assert isinstance(pl.to_torch(model, device_map=CPUS, concurrent=True), PipelinedModule)
    assert not concurrent_pays(model, ["cpu"], None, "auto", cores=2)
    assert not concurrent_pays(model, ["cuda:0"], True, "auto")  # GPU stages overlap on streams
    # a 256-wide MLP at 256 tokens: each branch does 256 x 131072 multiply-adds, which pays
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    big = pl.from_torch(wide, (torch.randn(256, 256),))
    pl.split_tensor_parallel(big, devices=[0, 1])
    assert concurrent_pays(big, ["cpu"], None, "auto", cores=2)
    assert not concurrent_pays(big, ["cpu"], None, "auto", cores=1)
    assert not concurrent_pays(big, ["cpu"], False, "threads", cores=2)
    # an unsplit chain never runs as a DAG
    chain = pl.from_torch(wide, (torch.randn(256, 256),))
    assert not concurrent_pays(chain, ["cpu"], True, "auto")


def test_the_option_is_checked_and_can_be_turned_off(tiny_gpt):
    _, idx, model = tiny_gpt
    with pytest.raises(InputError, match="concurrent must be"):
        pl.to_torch(model, device_map=CPUS, concurrent="yes")
    with pytest.raises(InputError, match="executor='inline'"):
        pl.to_torch(model, device_map=CPUS, chunks=2, executor="inline", concurrent=True)
    module = pl.to_torch(model, device_map=CPUS, chunks=2, executor="threads", concurrent=False)
    with torch.no_grad():
        module(idx)
    assert module.stats.concurrent == 0 and module.stats.timeline == []
    module.concurrent = None  # the default, with threads asked for: on
    with torch.no_grad():
        module(idx)
    assert module.stats.concurrent == 2


def test_a_2d_split_pipelines_its_micro_batches_and_runs_each_stage_group_at_once():
    """Tensor inside pipeline: the tiny GPT as two pipeline stages, each split over two
    devices; with ``chunks=2`` the micro-batches pipeline and each group's branches run at once."""
    net, (idx,) = gpt.build("tiny")
    idx = torch.cat([idx, idx.flip(0)], 0)
    model = pl.from_torch(net, (idx,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 2})
    pl.inject_cross_device_copies(model)
    pl.split_tensor_parallel(model, devices=[[0, 1], [2, 3]])
    module = pl.to_torch(model, device_map=dict.fromkeys(range(4), "cpu"), chunks=2, concurrent=True)
    out = module(idx)
    assert module.stats.concurrent == 2
    ran = {(r.stage, r.microbatch) for r in module.stats.timeline}
    assert ran == {(j, i) for j in range(len(module.stages)) for i in (0, 1)}
    net.zero_grad()
    expected = net(idx)
    torch.testing.assert_close(out, expected, **TOL)
    expected.square().mean().backward()
    out.square().mean().backward()
    assert _shard_grads_match(net, module) >= 8
    for p in module.parameters():
        p.grad = None
    loss = module.train_step(idx, loss_fn=lambda o: o.square().mean())
    torch.testing.assert_close(loss, expected.square().mean().detach(), **TOL)
    assert _shard_grads_match(net, module) >= 8


def test_a_one_micro_batch_dag_checks_its_inputs_and_survives_a_copy():
    import copy

    net, (x,) = mlp.build("tiny")
    module = pl.to_torch(_split(net, x, dynamic=False), device_map=CPUS, concurrent=True)
    with pytest.raises(InputError, match="input"):
        module(x.double())
    twin = copy.deepcopy(module)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), net(x), **TOL)
    assert twin.stats.concurrent == 2
