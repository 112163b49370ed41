"""A placed model run as 2 and 3 real gloo ranks equals ``pl.run`` / single-process training."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch

import placement as pl
from tests.conftest import export_once
from tests.distributed import workers
from tests.distributed.harness import spawn

# the module-scoped fixture (process groups of real ranks) runs once: every test of this module on
# one xdist worker (--dist loadgroup)
pytestmark = [pytest.mark.xdist_group("distributed_pipeline"), pytest.mark.slow]  # slow: real process groups

MODELS = ["mlp", "resnet", "gpt", "unet"]
TRAIN = [("gpt", 3, "gpipe"), ("resnet", 2, "1f1b")]


def _build(name: str, seed: int):
    from placement import models

    return models.build(name, "tiny", seed=seed)


def place(name: str, n: int) -> tuple[pl.Model, list[np.ndarray]]:
    """``name`` on ``n`` logical GPUs and a batch of 2 micro-batches."""
    model, _, args = export_once(name)  # exported once per test session
    model = model.copy()
    pl.place_evenly(model, n)  # Caffe2 style: equal runs of activations, shifted, with copies
    _, more = _build(name, 1)
    batch = [np.concatenate([a.numpy(), b.numpy()]) for a, b in zip(args, more)]
    return model, batch


@functools.cache
def _export_dynamic(name: str) -> tuple[pl.Model, tuple]:
    from placement.cli.common import batch_dynamic_shapes

    net, args = _build(name, 0)
    return pl.from_torch(net, args, dynamic_shapes=batch_dynamic_shapes(args)), args


def place_dynamic(name: str, n: int) -> pl.Model:
    """``name`` exported with a dynamic batch (``placement place --dynamic-batch``) on ``n`` logical GPUs."""
    model, _ = _export_dynamic(name)
    model = model.copy()
    pl.place_evenly(model, n)
    return model


#: a dynamic-batch gpt on 3 ranks: (rows, chunks) per run; none is the export's batch of 2 per
#: micro-batch, the shapes change from run to run, and the first comes back (a kept stage)
DYNAMIC_RUNS = [(6, 3), (5, None), (3, 1), (6, 3)]


def _dynamic_case(tmp) -> tuple[dict, list[np.ndarray]]:
    model = place_dynamic("gpt", 3)
    path = tmp / "gpt3_dynamic.onnx"
    model.save(path)
    rng = np.random.default_rng(0)
    runs, expected = [], []
    for i, (rows, chunks) in enumerate(DYNAMIC_RUNS):
        idx = rng.integers(0, 64, (rows, 8))
        np.save(tmp / f"dynamic{i}.npy", idx)
        runs.append({"inputs": str(tmp / f"dynamic{i}.npy"), "chunks": chunks})
        expected.append(pl.run(model, [idx], device_map="cpu")[0])
    return {"key": "gpt3_dynamic", "ranks": 3, "path": str(path), "runs": runs}, expected


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory):
    """One spawn of 3 ranks runs every case; returns (results, expected)."""
    tmp = tmp_path_factory.mktemp("zoo")
    cases, expected = [], {}
    placed = {}
    for name in MODELS:
        for n in (2, 3):
            model, batch = place(name, n)
            path = tmp / f"{name}{n}.onnx"
            model.save(path)
            model = pl.load(path)
            placed[name, n] = (path, model, batch)
            np.savez(tmp / f"{name}{n}_in.npz", *batch)
            rows = model.graph.inputs[0].shape[0]
            chunks = [[a[i : i + rows] for a in batch] for i in range(0, len(batch[0]), rows)]
            outs = [pl.run(model, c) for c in chunks]
            expected[f"{name}{n}/out"] = [np.concatenate(parts) for parts in zip(*outs)]
            cases.append(
                {"key": f"{name}{n}", "ranks": n, "path": str(path), "inputs": str(tmp / f"{name}{n}_in.npz")}
            )
    for name, n, schedule in TRAIN:
        path, model, batch = placed[name, n]
        module = pl.to_torch(model, device_map="cpu")
        rows = model.graph.inputs[0].shape[0]
        out_shape = module(*[torch.from_numpy(a[:rows]) for a in batch]).shape
        target = np.random.default_rng(0).standard_normal((len(batch[0]), *out_shape[1:])).astype(np.float32)
        np.save(tmp / f"{name}{n}_target.npy", target)
        losses = []
        for i in range(0, len(batch[0]), rows):
            out = module(*[torch.from_numpy(a[i : i + rows]) for a in batch])
            losses.append(workers._mse(out, torch.from_numpy(target[i : i + rows])))
        loss = torch.stack(losses).mean()
        loss.backward()
        expected[f"train_{name}{n}/loss"] = float(loss.detach())
        expected[f"train_{name}{n}/grads"] = {k: p.grad.numpy() for k, p in module.named_parameters()}
        cases.append(
            {
                "key": f"train_{name}{n}",
                "ranks": n,
                "path": str(path),
                "inputs": str(tmp / f"{name}{n}_in.npz"),
                "target": str(tmp / f"{name}{n}_target.npy"),
                "schedule": schedule,
            }
        )
    dynamic, expected["gpt3_dynamic/out"] = _dynamic_case(tmp)
    cases.append(dynamic)
    cases[0]["path2"] = str(placed["mlp", 2][0])
    gpt3 = placed["gpt", 3][0]
    cases[0]["kill"] = {
        "path": str(gpt3),
        "inputs": str(tmp / "gpt3_in.npz"),
        "victim": 1,
        "outdir": str(tmp),
    }
    codes = spawn(workers.zoo, 3, cases, str(tmp), timeout=120)
    results: dict = {}
    for rank in range(3):
        with open(tmp / f"rank{rank}.pkl", "rb") as f:
            results.update(pickle.load(f))
    errors = [v for k, v in results.items() if k.startswith("error/")]
    assert not errors, errors[0]
    assert codes[0] == codes[2] == 0 and codes[1] != 0  # rank 1 killed itself at the end
    return results, expected


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_outputs_equal_pl_run(zoo_run, name, ranks):
    results, expected = zoo_run
    got, want = results[f"{name}{ranks}/out"], expected[f"{name}{ranks}/out"]
    assert len(got) == len(want) and results[f"{name}{ranks}/kept"]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_dynamic_batch_runs_any_rows_and_chunks(zoo_run):
    """A dynamic-batch export on 3 ranks: reshape targets built from the batch reach the later
    ranks as shape tokens, and each run's micro-batch shape gets its own torch stage."""
    results, expected = zoo_run
    for i, want in enumerate(expected["gpt3_dynamic/out"]):
        got = results[f"gpt3_dynamic/out/{i}"]
        assert got.shape == want.shape, DYNAMIC_RUNS[i]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(DYNAMIC_RUNS[i]))


@pytest.mark.parametrize("name,ranks,schedule", TRAIN)
def test_training_gradients_equal_single_process(zoo_run, name, ranks, schedule):
    results, expected = zoo_run
    key = f"train_{name}{ranks}"
    assert results[f"{key}/loss"] == pytest.approx(expected[f"{key}/loss"], rel=1e-5)
    want = expected[f"{key}/grads"]
    seen = set()
    for rank in range(ranks):
        for param, grad in results[f"{key}/grads/{rank}"].items():
            np.testing.assert_allclose(
                grad, want[param], rtol=1e-4, atol=1e-6, err_msg=f"{param} on rank {rank}"
            )
            seen.add(param)
    assert seen == set(want)  # every parameter lives on some rank


def test_world_size_mismatch_names_both_numbers(zoo_run):
    results, _ = zoo_run
    message = results["world_size_error/0"]
    assert "world size 3" in message and "2 rank(s)" in message


def test_killed_rank_is_named_by_the_others(zoo_run):
    """After the cases above, rank 1 is killed (SIGKILL): ranks 0 and 2 fail fast, naming it."""
    results, _ = zoo_run
    for rank in (0, 2):
        seconds, message = results[f"killed/{rank}"]
        assert "RankFailedError ranks=[1]" in message and "rank 1 stopped without a report" in message, (
            message
        )
        assert seconds < 15, f"rank {rank} took {seconds:.1f} s to notice"  # not the 30 s timeout


def test_one_rank_world_checks_rows_against_chunks():
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, free_port

    model, batch = place("mlp", 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with DistributedPipeline(model, ranks="cuda:0+cuda:1") as pipe:
            with pytest.raises(pl.InputError, match="chunks=3"):
                pipe.run(batch, chunks=3)
    finally:
        dist.destroy_process_group()


def test_one_rank_world_runs_a_dynamic_batch_at_any_rows():
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, free_port

    model = place_dynamic("gpt", 2)
    rng = np.random.default_rng(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with DistributedPipeline(model, ranks="cuda:0+cuda:1") as pipe:
            for rows, chunks in [(6, 3), (5, None), (6, 3)]:
                idx = rng.integers(0, 64, (rows, 8))
                (got,) = pipe.run([idx], chunks=chunks)
                (want,) = pl.run(model, [idx], device_map="cpu")
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            with pytest.raises(pl.InputError, match="5 rows, which do not split into 2 equal"):
                pipe.run([np.zeros((5, 8), np.int64)], chunks=2)
    finally:
        dist.destroy_process_group()
