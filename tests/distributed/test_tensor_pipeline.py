"""A 2D split (tensor parallelism inside 2 pipeline stages) of the tiny gpt as 4 real gloo ranks:
outputs bitwise the emulated split's, gradients the unsplit model's, `placement launch` on the file."""

from __future__ import annotations

import pickle
import subprocess
import sys
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import placement as pl
from placement.distributed import DistributedTensorPipeline, WorldSizeError, free_port
from placement.distributed.grid import grid_groups, split_grid
from placement.distributed.split import trains_through_shape_tokens
from placement.distributed.spmd import spmd_devices
from placement.errors import InputError, PlacementError
from placement.models import gpt
from tests.distributed import grid_workers, tp_workers
from tests.distributed.harness import spawn
from tests.distributed.test_tensor_ranks import _check_gradients

pytestmark = [pytest.mark.xdist_group("distributed_tensor_parallel"), pytest.mark.slow]  # real process groups

GROUPS = [[0, 1], [2, 3]]

# the grid's second stage reads the shape of the token ids (a shape token crosses the stages)
needs_token_training = pytest.mark.skipif(
    not trains_through_shape_tokens(),
    reason="this torch's pipelining cannot train a stage receiving an integer shape token "
    "(placement.distributed.split.trains_through_shape_tokens)",
)


def _gpt_2d(*, dynamic: bool = False) -> tuple[torch.nn.Module, torch.Tensor, pl.Model]:
    """The tiny gpt (graph batch 2, or a dynamic batch) as 2 pipeline stages, each split over 2 devices."""
    net, (idx,) = gpt.build("tiny")
    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    model = pl.from_torch(net, (idx,), dynamic_shapes=shapes)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 2})
    pl.inject_cross_device_copies(model)
    pl.split_tensor_parallel(model, devices=GROUPS)
    return net, idx, model


def _emulated(model: pl.Model, idx: np.ndarray) -> np.ndarray:
    module = pl.to_torch(model, device_map={str(d): "cpu" for d in model.devices})
    with torch.no_grad():
        return module(torch.from_numpy(idx)).numpy()


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    """One spawn of 4 ranks: runs of 1 and 2 micro-batches and a training step of 2."""
    tmp = tmp_path_factory.mktemp("grid")
    net, idx, model = _gpt_2d()
    path = tmp / "gpt_2x2.onnx"
    model.save(path)
    _gpt_2d(dynamic=True)[2].save(tmp / "gpt_2x2_dynamic.onnx")
    rows = np.concatenate([idx.numpy(), idx.numpy()[::-1]])  # 2 micro-batches of the graph's batch
    target = np.random.default_rng(0).integers(0, 64, rows.shape)
    np.savez(tmp / "data.npz", idx=rows, target=target)
    data = str(tmp / "data.npz")
    codes = spawn(
        grid_workers.gpt_grid, 4, str(path), str(tmp / "gpt_2x2_dynamic.onnx"), data, str(tmp), timeout=400
    )
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    return results, net, (rows, target), pl.load(path)


@needs_token_training
def test_ranks_form_a_grid_of_groups_and_chains(grid_run):
    results, _, _, model = grid_run
    assert [res["place"] for res in results] == [(0, 0, False), (0, 1, False), (1, 0, True), (1, 1, False)]
    # each group issues its own collectives; rank 3 takes part in the logits' all-gather unread
    first = [("all_reduce", i, False) for i in range(3)]
    assert results[0]["collectives"] == results[1]["collectives"] == first
    assert results[2]["collectives"] == [
        ("all_reduce", 3, False),
        ("all_reduce", 4, False),
        ("all_gather", 5, False),
    ]
    assert results[3]["collectives"][-1] == ("all_gather", 5, True)
    # the tied embedding / LM head shard is read at both stages of its chain
    assert results[0]["shared"] == results[2]["shared"] == {"lm_head.weight.tp0": [0, 1]}
    assert results[1]["shared"] == results[3]["shared"] == {"lm_head.weight.tp1": [0, 1]}
    assert [[str(d) for d in g] for g in grid_groups(model)] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]


@needs_token_training
def test_outputs_are_bitwise_the_emulated_2d_split(grid_run):
    results, net, (rows, _), model = grid_run
    half = len(rows) // 2
    out = results[2]
    assert all("out/1" not in res for r, res in enumerate(results) if r != 2)  # rank 2 holds them
    np.testing.assert_array_equal(out["out/1"], _emulated(model, rows[:half]))
    per_micro_batch = np.concatenate([_emulated(model, rows[:half]), _emulated(model, rows[half:])])
    np.testing.assert_array_equal(out["out/2"], per_micro_batch)
    expected = net(torch.from_numpy(rows)).detach().numpy()
    np.testing.assert_allclose(out["out/2"], expected, rtol=1e-5, atol=1e-5)


@needs_token_training
def test_gradients_on_the_grid_equal_the_unsplit_model(grid_run):
    results, net, (rows, target), model = grid_run
    net.zero_grad()
    loss = tp_workers.cross_entropy(net(torch.from_numpy(rows)), torch.from_numpy(target))
    loss.backward()
    np.testing.assert_allclose(results[2]["loss"], float(loss.detach()), rtol=1e-5)
    params = dict(net.named_parameters())
    expected = {k: p.grad for k, p in params.items()}
    checked = _check_gradients(results, model, params, expected, {"lm_head.weight": "wte.weight"})
    assert checked == set(params)


@needs_token_training
def test_1f1b_with_a_dynamic_batch_gives_the_unsplit_gradients(grid_run):
    """Shape values of the dynamic batch cross stages as shape tokens; 1F1B interleaves the
    micro-batches' forwards and backwards, each stage's collectives in one order on its group."""
    results, net, (rows, target), model = grid_run
    net.zero_grad()
    loss = tp_workers.cross_entropy(net(torch.from_numpy(rows)), torch.from_numpy(target))
    loss.backward()
    np.testing.assert_allclose(results[2]["1f1b/loss"], float(loss.detach()), rtol=1e-5)
    params = dict(net.named_parameters())
    grads = [{"grads": res["1f1b/grads"]} for res in results]
    checked = _check_gradients(
        grads, model, params, {k: p.grad for k, p in params.items()}, {"lm_head.weight": "wte.weight"}
    )
    assert checked == set(params)


def test_world_size_and_other_splits_are_refused(tmp_path):
    _, _, model = _gpt_2d()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:
        with pytest.raises(WorldSizeError, match="world size 1 does not match the placement: it has 4"):
            DistributedTensorPipeline(model, heartbeat=0)
    finally:
        dist.destroy_process_group()
    with pytest.raises(PlacementError, match="DistributedTensorPipeline"):
        spmd_devices(model)  # what DistributedTensorParallel (one group over every rank) says
    from placement.models import mlp

    flat = pl.from_torch(*mlp.build("tiny"))
    pl.split_tensor_parallel(flat, devices=[0, 1])
    module = pl.to_torch(flat, device_map="cpu")
    assert len(grid_groups(flat)) == 1
    with pytest.raises(InputError, match="out of range"):
        split_grid(module, flat, rank=2)


def test_placement_launch_runs_a_2d_split_on_4_ranks(tmp_path):
    net, idx, model = _gpt_2d()
    model.save(tmp_path / "gpt_2x2.onnx")
    rows = np.concatenate([idx.numpy(), idx.numpy()[::-1]])
    np.save(tmp_path / "idx.npy", rows)
    command = [sys.executable, "-m", "placement.cli", "launch", "gpt_2x2.onnx", "--input", "idx=idx.npy"]
    command += ["--output", "out.npz", "--timeout", "120"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nproc-per-node=4" in done.stdout and "rank 2 wrote" in done.stdout
    got = np.load(tmp_path / "out.npz")[model.outputs[0]]
    np.testing.assert_allclose(got, net(torch.from_numpy(rows)).detach().numpy(), rtol=1e-5, atol=1e-5)
    # a world that does not fit: 2 ranks for 4 devices, named
    command += ["--nproc-per-node", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode != 0
    assert "world size 2 does not match the placement: it has 4 rank(s)" in done.stdout + done.stderr
