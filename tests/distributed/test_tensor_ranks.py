"""A tensor-parallel gpt run as 2 real gloo ranks: outputs bitwise equal to the emulated split,
gradients equal to the unsplit model's, one collective per tagged collective."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import placement as pl
from placement.graph.nodes import collective_tag
from placement.models import gpt
from tests.distributed import tp_workers
from tests.distributed.harness import spawn

pytestmark = [pytest.mark.xdist_group("distributed_tensor_parallel"), pytest.mark.slow]  # real process groups


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """One spawn of 2 ranks: a run and a training step; returns (results per rank, net, data, model)."""
    tmp = tmp_path_factory.mktemp("tp")
    net, (idx,) = gpt.build("tiny")
    model = pl.from_torch(net, (idx,))
    result = pl.split_tensor_parallel(model, devices=[0, 1])
    assert (result.all_reduces, result.all_gathers) == (5, 1)  # embedding + 2 per block; logits
    path = tmp / "gpt_tp2.onnx"
    model.save(path)
    rng = np.random.default_rng(0)
    target = rng.integers(0, 64, idx.shape)
    np.savez(tmp / "data.npz", idx=idx.numpy(), target=target)
    codes = spawn(tp_workers.gpt_ranks, 2, str(path), str(tmp / "data.npz"), str(tmp), timeout=180)
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == {0: 0, 1: 0}
    return results, net, (idx, target), model


def test_gloo_outputs_are_bitwise_the_emulated_split(gpt_run):
    results, net, (idx, _), _ = gpt_run
    out = results[0]["out"]
    assert out.shape == (*idx.shape, 64)
    np.testing.assert_array_equal(out, results[0]["emulated"])  # bitwise: t=2 sums commute exactly
    np.testing.assert_allclose(out, net(idx).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_ort_ranks_are_bitwise_the_emulated_runner(gpt_run):
    results, net, (idx, _), _ = gpt_run
    np.testing.assert_array_equal(results[0]["ort_out"], results[0]["ort_emulated"])
    np.testing.assert_allclose(results[0]["ort_out"], net(idx).detach().numpy(), rtol=1e-5, atol=1e-5)
    assert [res["ort_issued"] for res in results] == [6, 6]  # one call per tagged collective


def test_one_collective_per_tagged_collective(gpt_run):
    results, _, _, model = gpt_run
    tags = {tag["id"]: tag["kind"] for n in model.graph if (tag := collective_tag(n)) is not None}
    reduces = sum(kind == "all_reduce" for kind in tags.values())
    assert reduces == 1 + 2 * 2  # the vocab-parallel embedding, then 2 per transformer block
    for res in results:
        assert res["forward_calls"] == {"calls/all_reduce": reduces, "calls/all_gather": len(tags) - reduces}
        assert res["issued_after_run"] == {"forward": len(tags), "backward": 0}
        assert [c[:2] for c in res["collectives"]] == sorted(
            ((k, i) for i, k in tags.items()), key=lambda c: c[1]
        )
    # rank 1 takes part in the logits' all-gather without reading it (the outputs live on rank 0)
    assert [c[2] for c in results[1]["collectives"]] == [False] * 5 + [True]


def test_backward_runs_megatron_f_and_g(gpt_run):
    results, _, _, _ = gpt_run
    for res in results:
        step = res["issued_after_step"]
        # forward again: 6; backward: g is the identity, f all-reduces the input gradient of each
        # column-parallel linear (2 per block, the tied LM head), and the logits' all-gather
        # hands rank 0's gradient to rank 1 (1 all-reduce)
        assert step == {"forward": 12, "backward": 2 * 2 + 1 + 1}


def _unsplit_gradients(net, idx, target) -> dict[str, torch.Tensor]:
    net.zero_grad()
    logits = net(idx)
    tp_workers.cross_entropy(logits, torch.from_numpy(target)).backward()
    return {name: p.grad for name, p in net.named_parameters()}


def _whole(shard: np.ndarray, full: np.ndarray) -> tuple[int, list[int]]:
    """Where a shard of ``full`` sits: its axis and indices, found from the (random) values."""
    for axis in range(full.ndim):
        if shard.shape[:axis] + shard.shape[axis + 1 :] != full.shape[:axis] + full.shape[axis + 1 :]:
            continue
        rows = np.moveaxis(full, axis, 0).reshape(full.shape[axis], -1)
        wanted = np.moveaxis(shard, axis, 0).reshape(shard.shape[axis], -1)
        index = [int(np.flatnonzero((rows == w).all(1))[0]) for w in wanted if (rows == w).all(1).any()]
        if len(index) == len(wanted):
            return axis, index
    raise AssertionError(f"a shard of shape {shard.shape} is not a slice of {full.shape}")


def _check_gradients(results, model, params, expected, aliases=None) -> set[str]:
    """Every rank's gradients against the unsplit ones (a shard's: the slice of the whole)."""
    paths = pl.to_torch(model, device_map={str(d): "cpu" for d in model.devices}).initializer_paths
    onnx_name = {path: name for name, path in paths.items()}
    checked = set()
    for rank, res in enumerate(results):
        for path, grad in res["grads"].items():
            name = onnx_name[path]
            base = name.split(".tp")[0] if ".tp" in name else name
            base = (aliases or {}).get(base, base)
            full = params[base].detach().numpy()
            value = model.graph.initializers[name].const_value.numpy()
            want = expected[base].numpy()
            if value.shape != full.shape:
                axis, index = _whole(value, full)
                want = np.take(want, index, axis)
            np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank} {name}")
            checked.add(base)
    return checked


def test_gradients_on_ranks_equal_the_unsplit_model(gpt_run):
    results, net, (idx, target), model = gpt_run
    expected = _unsplit_gradients(net, idx, target)
    params = dict(net.named_parameters())
    np.testing.assert_allclose(
        results[0]["loss"],
        float(tp_workers.cross_entropy(net(idx), torch.from_numpy(target)).detach()),
        rtol=1e-6,
    )
    checked = _check_gradients(results, model, params, expected, {"lm_head.weight": "wte.weight"})
    assert checked == set(params)  # every parameter of the unsplit model (the tied one once)


def test_three_ranks_ragged_shards_ring_and_device_order(tmp_path):
    from placement.models import mlp

    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    pl.split_tensor_parallel(model, devices=[0, 1, 2])  # 32 hidden: 11, 11, 10; 8 outputs: 3, 3, 2
    path = tmp_path / "mlp_tp3.onnx"
    model.save(path)
    target = np.random.default_rng(1).standard_normal((x.shape[0], 8)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x.numpy(), target=target)
    codes = spawn(
        tp_workers.mlp_three_ranks, 3, str(path), str(tmp_path / "data.npz"), str(tmp_path), timeout=180
    )
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(3)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == {0: 0, 1: 0, 2: 0}
    ring, ordered, emulated = results[0]["out/False"], results[0]["out/True"], results[0]["emulated"]
    np.testing.assert_array_equal(ordered, emulated)  # device-order sums: bitwise at any degree
    np.testing.assert_allclose(ring, emulated, rtol=1e-6, atol=1e-6)  # gloo's ring: rounding only
    np.testing.assert_allclose(ring, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    net.zero_grad()
    tp_workers.mse(net(x), torch.from_numpy(target)).backward()
    params = dict(net.named_parameters())
    checked = _check_gradients(results, model, params, {k: p.grad for k, p in params.items()})
    assert checked == set(params)


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_stage_collectives_through_the_host(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    net, (idx,) = gpt.build("tiny")
    model = pl.from_torch(net, (idx,))
    pl.split_tensor_parallel(model, devices=[0, 1])
    path = tmp_path / "gpt_tp2.onnx"
    model.save(path)
    np.savez(tmp_path / "data.npz", idx=idx.numpy())
    codes = spawn(
        tp_workers.gpt_on_one_gpu, 2, str(path), str(tmp_path / "data.npz"), str(tmp_path), timeout=180
    )
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == {0: 0, 1: 0}
    # TF32 off: the ranks' GPU matmuls are the emulated split's (same shapes) up to rounding
    np.testing.assert_allclose(results[0]["out"], results[0]["emulated"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[0]["out"], net(idx).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_placement_launch_runs_a_split_as_tensor_parallel_ranks(tmp_path):
    import subprocess
    import sys

    net, (idx,) = gpt.build("tiny")
    model = pl.from_torch(net, (idx,))
    pl.split_tensor_parallel(model, devices=[0, 1])
    model.save(tmp_path / "gpt_tp2.onnx")
    np.save(tmp_path / "idx.npy", idx.numpy())
    command = [sys.executable, "-m", "placement.cli", "launch", "gpt_tp2.onnx", "--input", "idx=idx.npy"]
    command += ["--output", "out.npz", "--timeout", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nproc-per-node=2" in done.stdout and "rank 0 wrote" in done.stdout
    got = np.load(tmp_path / "out.npz")[model.outputs[0]]
    np.testing.assert_allclose(got, net(idx).detach().numpy(), rtol=1e-5, atol=1e-5)
