"""A placed model served as 2 real gloo ranks on ONNX Runtime equals ``pl.run``; the plan in one process."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import placement as pl
from placement.distributed import NotAPipelineError, rank_groups, rank_plan
from placement.distributed.ort_ranks import rank_program
from placement.runtime.device_map import PhysicalDevice
from tests.distributed import ort_workers
from tests.distributed.harness import spawn
from tests.distributed.test_torch_ranks import place

# the module-scoped fixture (process groups of real ranks) runs once: every test of this module on
# one xdist worker (--dist loadgroup)
pytestmark = [pytest.mark.xdist_group("distributed_ort_ranks"), pytest.mark.slow]  # slow: real process groups

CASES = [("mlp", 2, None), ("gpt", 2, None), ("gpt", 3, "cuda:0+cuda:1,cuda:2")]


def _expected(model: pl.Model, batch: list[np.ndarray], rows: int | None = None) -> list[np.ndarray]:
    """``pl.run`` micro-batch by micro-batch, joined."""
    rows = rows or model.graph.inputs[0].shape[0]
    outs = [pl.run(model, [a[i : i + rows] for a in batch]) for i in range(0, len(batch[0]), rows)]
    return [np.concatenate(parts) for parts in zip(*outs)]


def _dynamic_mlp() -> tuple[pl.Model, list[np.ndarray]]:
    import torch

    from placement import models

    net, (x,) = models.build("mlp", "tiny")
    model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    pl.place_evenly(model, 2)
    return model, [np.random.default_rng(0).standard_normal((6, *x.shape[1:])).astype(np.float32)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One spawn of 2 ranks runs every case; returns (results, expected)."""
    tmp = tmp_path_factory.mktemp("ort")
    cases, expected = [], {}
    for name, n, ranks in CASES:
        model, batch = place(name, n)
        key = f"{name}{n}"
        model.save(tmp / f"{key}.onnx")
        np.savez(tmp / f"{key}_in.npz", *batch)
        expected[key] = _expected(model, batch)
        cases.append({"key": key, "path": str(tmp / f"{key}.onnx"), "inputs": str(tmp / f"{key}_in.npz")})
        cases[-1]["ranks"] = ranks
    cases[0]["three"] = cases[-1]["path"]  # 3 devices, one per rank by default: not a world of 2
    # a dynamic batch: wires carry a shape header; 2 micro-batches of 3 rows
    model, batch = _dynamic_mlp()
    model.save(tmp / "dyn.onnx")
    np.savez(tmp / "dyn_in.npz", *batch)
    expected["dyn"] = _expected(model, batch, rows=3)
    cases.append(
        {"key": "dyn", "path": str(tmp / "dyn.onnx"), "inputs": str(tmp / "dyn_in.npz"), "chunks": 2}
    )
    codes = spawn(ort_workers.serve, 2, cases, str(tmp), timeout=120)
    results: dict = {}
    for rank in range(2):
        with open(tmp / f"ort_rank{rank}.pkl", "rb") as f:
            results.update(pickle.load(f))
    errors = [v for k, v in results.items() if k.startswith("error/")]
    assert not errors, errors[0]
    assert codes[0] == 0 and codes[1] != 0  # rank 1 killed itself at the end
    return results, expected


@pytest.mark.parametrize("key", [f"{name}{n}" for name, n, _ in CASES] + ["dyn"])
def test_outputs_equal_pl_run(served, key):
    results, expected = served
    got, want = results[f"{key}/out"], expected[key]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_world_size_mismatch_names_both_numbers(served):
    results, _ = served
    message = results["world_size_error/0"]
    assert "world size 2" in message and "3 rank(s)" in message


def test_killed_rank_is_named(served):
    """After the cases, rank 1 is killed (SIGKILL): rank 0 fails fast, naming it."""
    results, _ = served
    seconds, message = results["killed/0"]
    assert "RankFailedError ranks=[1]" in message and "rank 1 stopped without a report" in message, message
    assert seconds < 15, f"rank 0 took {seconds:.1f} s to notice"  # not the 30 s timeout


@pytest.mark.slow
def test_placement_launch_runtime_ort(tmp_path):
    """``placement launch --runtime ort``: torchrun, 2 ranks of ORT sessions, 2 micro-batches."""
    model, batch = place("gpt", 2)
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "idx.npy", batch[0])
    command = [
        sys.executable,
        "-m",
        "placement.cli",
        "launch",
        str(tmp_path / "placed.onnx"),
        "--runtime",
        "ort",
    ]
    command += ["--input", f"{model.inputs[0]}={tmp_path / 'idx.npy'}", "--output", str(tmp_path / "out.npz")]
    done = subprocess.run(
        command + ["--timeout", "60"], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nproc-per-node=2" in done.stdout and "--runtime ort" in done.stdout
    got = np.load(tmp_path / "out.npz")
    assert list(got.keys()) == model.outputs
    for name, want in zip(model.outputs, _expected(model, batch)):
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_rank_programs_chained_in_one_process_equal_pl_run():
    """Three ranks' programs, fed by their wires in one process: skips go straight to their reader."""
    model, batch = place("unet", 3)
    rows = model.graph.inputs[0].shape[0]
    inputs = [a[:rows] for a in batch]
    groups = rank_groups(model)
    cpu = {d: PhysicalDevice("cpu") for d in model.devices}
    sent: dict[tuple[str, int], np.ndarray] = {}
    for r in range(3):
        plan = rank_plan(model, groups, r)
        assert all(w.dst == r and w.src < r for w in plan.receives)
        feed = (inputs if r == 0 else []) + [sent[w.blob, r] for w in plan.receives]
        outs = rank_program(model, plan, cpu).run(feed)
        names = plan.partition.outputs
        sent.update({(w.blob, w.dst): outs[names.index(w.blob)] for w in plan.sends})
    assert any(w.src == 0 for w in plan.receives)  # a skip from rank 0 to rank 2, not through rank 1
    for got, want in zip(outs[: plan.n_graph_outputs], pl.run(model, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_later_rank_feeding_an_earlier_one_is_refused():
    model, _ = place("mlp", 3)
    backwards = [[pl.Device("cuda", 2)], [pl.Device("cuda", 1)], [pl.Device("cuda", 0)]]
    with pytest.raises(NotAPipelineError, match="earlier rank"):
        rank_plan(model, backwards, 0)


def test_one_rank_world_checks_rows_against_chunks():
    import torch.distributed as dist

    from placement.distributed import DistributedRunner, free_port

    model, batch = place("mlp", 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with DistributedRunner(model, ranks="cuda:0+cuda:1") as runner:
            (out,) = runner.run(batch)  # 2 micro-batches from the rows
            np.testing.assert_allclose(out, _expected(model, batch)[0], rtol=1e-4, atol=1e-5)
            with pytest.raises(pl.InputError, match="chunks=3"):
                runner.run(batch, chunks=3)
    finally:
        dist.destroy_process_group()
