"""``placement launch`` runs torchrun on ``python -m placement.launch``: 2 ranks, outputs equal pl.run
(static and dynamic-batch exports, both runtimes)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import placement as pl
from placement.cli import main
from placement.launch import read_inputs
from tests.distributed.test_torch_ranks import place, place_dynamic


@pytest.mark.slow  # real torchrun processes
def test_launch_two_ranks_with_torchrun(tmp_path):
    model, batch = place("resnet", 2)
    model.save(tmp_path / "placed.onnx")
    np.save(tmp_path / "x.npy", batch[0])
    name = model.inputs[0]
    command = [sys.executable, "-m", "placement.cli", "launch", str(tmp_path / "placed.onnx")]
    command += [
        "--input",
        f"{name}={tmp_path / 'x.npy'}",
        "--output",
        str(tmp_path / "out.npz"),
        "--timeout",
        "60",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nproc-per-node=2" in done.stdout and "--loopback" in done.stdout
    got = np.load(tmp_path / "out.npz")
    assert list(got.keys()) == model.outputs
    rows = model.graph.inputs[0].shape[0]
    want = np.concatenate([pl.run(model, [batch[0][i : i + rows]])[0] for i in range(0, len(batch[0]), rows)])
    np.testing.assert_allclose(got[model.outputs[0]], want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # real torchrun processes
@pytest.mark.parametrize("runtime,chunks", [("torch", 3)])
def test_launch_a_dynamic_batch_export(tmp_path, runtime, chunks):
    """``placement place --dynamic-batch`` files launch with rows the export never saw (6 rows: 3
    micro-batches of 2); the outputs equal pl.run on the whole batch. The ORT runtime on a
    dynamic-batch export runs in the README's launch commands (tests/test_readme.py)."""
    model = place_dynamic("gpt", 2)
    model.save(tmp_path / "placed.onnx")
    idx = np.random.default_rng(0).integers(0, 64, (6, 8))
    np.save(tmp_path / "idx.npy", idx)
    command = [sys.executable, "-m", "placement.cli", "launch", "placed.onnx", "--input", "idx=idx.npy"]
    command += ["--output", "out.npz", "--timeout", "60", "--runtime", runtime]
    command += ["--chunks", str(chunks)] if chunks else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (want,) = pl.run(model, [idx], device_map="cpu")
    got = np.load(tmp_path / "out.npz")[model.outputs[0]]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_launch_multi_node_command(tmp_path, capsys):
    model, _ = place("mlp", 2)
    model.save(tmp_path / "placed.onnx")
    argv = ["launch", str(tmp_path / "placed.onnx"), "--input", "x.npy", "--dry-run"]
    assert main(argv + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "host0:29400"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=2" in out and "--rdzv-endpoint=host0:29400" in out and "--nproc-per-node=1" in out
    assert main(argv + ["--nnodes", "2"]) == 2  # no rendezvous endpoint
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_launch_refuses_unequal_micro_batches_before_starting_ranks(tmp_path, capsys):
    place_dynamic("gpt", 2).save(tmp_path / "placed.onnx")
    np.save(tmp_path / "idx.npy", np.zeros((5, 8), np.int64))
    argv = ["launch", str(tmp_path / "placed.onnx"), "--input", f"idx={tmp_path / 'idx.npy'}"]
    assert main(argv + ["--chunks", "2"]) == 2
    assert "'idx' has 5 rows, which do not split into --chunks 2" in capsys.readouterr().err


def test_read_inputs_names_the_bad_input(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(3))
    assert read_inputs([f"x={tmp_path / 'x.npy'}"], ["x"])["x"].shape == (3,)
    with pytest.raises(pl.InputError, match="'y' is not a graph input"):
        read_inputs([f"y={tmp_path / 'x.npy'}"], ["x"])
    with pytest.raises(pl.InputError, match="cannot read --input"):
        read_inputs([f"x={tmp_path / 'missing.npy'}"], ["x"])
