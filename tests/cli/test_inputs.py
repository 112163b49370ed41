"""The CLI needs no guessing about inputs: ``inspect`` shows each graph input's name, dtype and
shape (symbolic dimensions by name) and how to make an input file; ``run --input NAME=random`` /
``--random-inputs`` runs without files; ``place --dynamic-batch`` exports a batch axis that
``run --chunks`` pipelines; warnings go to stderr, once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import placement as pl
from placement import demo
from placement.cli import main
from placement.cli.inputs import parse_dims
from tests.cli.helpers import cli

# the module-scoped fixture runs once: every test of this module on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("cli_inputs")



@pytest.fixture(scope="module")
def dynamic_gpt(tmp_path_factory) -> Path:
    """``placement place gpt --dynamic-batch`` (tiny GPT on 2 logical devices), made once."""
    root = tmp_path_factory.mktemp("dynamic")
    assert main(["place", "gpt", "--dynamic-batch", "--devices", "2", "-o", str(root / "g.onnx")]) == 0
    return root / "g.onnx"


def test_inspect_shows_inputs_shapes_and_a_recipe(tmp_path, capsys):
    assert main(["inspect", "gpt"]) == 0
    out = capsys.readouterr().out
    assert "graph inputs and outputs" in out
    row = next(line for line in out.splitlines() if " idx " in line)
    assert "input" in row and "int64" in row and "[2, 8]" in row
    recipe = next(line for line in out.splitlines() if "np.save('idx.npy'" in line)
    assert "randint(0, 64, (2, 8))" in recipe  # indices valid for the 64-row embedding table
    assert "placement run PLACED.onnx --input idx=idx.npy" in out and "--input idx=random" in out

    # the recipe runs as printed and makes a file `run` accepts
    command = recipe.strip().split(" ", 2)[2].strip('"')
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, check=True)
    made = np.load(tmp_path / "idx.npy")
    assert made.dtype == np.int64 and made.shape == (2, 8) and made.max() < 64


def test_inspect_names_symbolic_dims(dynamic_gpt, capsys):
    assert main(["inspect", str(dynamic_gpt)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if " idx " in line)
    assert "int64" in row and "[batch, 8]" in row
    assert "symbolic dimensions batch set to 2" in out
    assert main(["inspect", str(dynamic_gpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"] == [{"name": "idx", "dtype": "int64", "shape": ["batch", 8], "kind": "tensor"}]
    assert data["outputs"][0]["shape"][0] == "batch"


def test_run_random_inputs_pipelined_on_a_dynamic_batch(dynamic_gpt, tmp_path, capsys):
    out_file = tmp_path / "o.npz"
    argv = ["run", str(dynamic_gpt), "--input", "idx=random", "--dim", "batch=4", "--chunks", "2"]
    assert main([*argv, "--repeat", "1", "--device-map", "cpu", "-o", str(out_file)]) == 0
    assert "latency" in capsys.readouterr().out
    (logits,) = np.load(out_file).values()
    assert logits.shape == (4, 8, 64)
    # the documented rule: seed 0, integers drawn from [0, rows of the table they index)
    idx = np.random.default_rng(0).integers(0, 64, (4, 8)).astype(np.int64)
    from placement.models import gpt

    net, _ = gpt.build("tiny")
    with torch.no_grad():
        expected = net(torch.from_numpy(idx)).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)

    # --random-inputs fills every input; symbolic dims default to 2 x chunks
    assert main(["run", str(dynamic_gpt), "--random-inputs", "--chunks", "2", "--repeat", "1"]) == 0
    assert "logits" not in capsys.readouterr().err
    again = tmp_path / "again.npz"
    assert main(["run", str(dynamic_gpt), "--random-inputs", "--repeat", "1", "-o", str(again)]) == 0
    assert next(iter(np.load(again).values())).shape == (2, 8, 64)


def test_place_dynamic_batch_of_a_static_onnx_file_is_refused(tmp_path, capsys):
    from placement.models import mlp

    net, args = mlp.build("tiny")
    pl.from_torch(net, args).save(tmp_path / "static.onnx")
    out = tmp_path / "p.onnx"
    assert main(["place", str(tmp_path / "static.onnx"), "--dynamic-batch", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "static.onnx" in err and "fixed batch size" in err and "dynamic_shapes" in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["resnet"])
def test_place_dynamic_batch_exports_a_batch_axis(name, tmp_path):
    assert main(["place", name, "--dynamic-batch", "-o", str(tmp_path / "m.onnx")]) == 0
    model = pl.load(tmp_path / "m.onnx")
    from placement.runtime.inputs import input_specs

    assert all(spec.shape[0] == "batch" for spec in input_specs(model.graph))
    net, (x,) = pl.models.build(name, "tiny")
    bigger = torch.cat([x, x, x])
    (got,) = pl.Runner(model, device_map="cpu", chunks=3).run([bigger.numpy()])
    with torch.no_grad():
        np.testing.assert_allclose(got, net(bigger).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--dim", "nope=3", "--input", "idx=random"], "nope"),
        (["--dim", "batch=0", "--input", "idx=random"], "--dim"),
        (["--dim", "batch", "--random-inputs"], "--dim"),
        ([], "--random-inputs"),
    ],
)
def test_bad_random_input_options_are_one_line(dynamic_gpt, argv, words, capsys):
    assert main(["run", str(dynamic_gpt), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def testparse_dims():
    assert parse_dims(["batch=8", "seq=4,x=2"]) == {"batch": 8, "seq": 4, "x": 2}
    assert parse_dims(None) == {}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="emulation is announced only without GPUs")
def test_emulation_warning_on_stderr_once(tmp_path):
    from placement.models import mlp

    model = pl.from_torch(*mlp.build("tiny"))
    pl.place_evenly(model, 2)
    model.save(tmp_path / "m.onnx")
    result = cli("run", "m.onnx", "--random-inputs", "--repeat", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "EMULATING" not in result.stdout and "(emulated)" in result.stdout
    assert result.stderr.count("EMULATING") == 1, result.stderr
    # the command line's spelling, not Python's
    assert "Pass --device-map cpu to run them" in result.stderr and "device_map=" not in result.stderr


def test_demo_warms_up_before_timing(monkeypatch):
    monkeypatch.setattr(demo, "_WARMUP_S", 0.05)
    calls: list[float] = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.005)

    demo._median_ms(fn, repeats=2)
    warmup = calls[:-2]
    assert len(warmup) >= demo._WARMUP_CALLS and warmup[-1] + 0.005 - warmup[0] >= 0.05
