"""Every sub-command through the real entry point (a subprocess running the ``placement`` script),
on zoo models and on an ONNX file from another exporter (TorchScript, ``dynamo=False``), errors included:
one line on stderr, exit status 2, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch

import placement as pl
from placement.report.draw import dot_available
from tests.cli.helpers import cli

# the module-scoped fixture runs once: every test of this module on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("cli_subcommands")



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs the commands read: an unplaced and a placed mlp, a TorchScript-exported resnet, arrays."""
    from placement.models import mlp, resnet

    root = tmp_path_factory.mktemp("cli-inputs")
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    model.save(root / "mlp.onnx")
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[2:], {0: 1})
    pl.inject_cross_device_copies(model)
    model.save(root / "mlp_placed.onnx")
    np.save(root / "x.npy", x.numpy())
    with torch.no_grad():
        np.save(root / "mlp_expected.npy", net(x).numpy())

    rnet, (image,) = resnet.build("tiny")
    torch.onnx.export(rnet, (image,), str(root / "resnet_ts.onnx"), dynamo=False, input_names=["image"])
    np.save(root / "image.npy", image.numpy())
    with torch.no_grad():
        np.save(root / "resnet_expected.npy", rnet(image).numpy())
    return root


@pytest.fixture
def work(tmp_path, files):
    for name in ("mlp.onnx", "mlp_placed.onnx", "resnet_ts.onnx", "x.npy", "image.npy"):
        shutil.copy(files / name, tmp_path / name)
    return tmp_path


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_help_lists_every_command(tmp_path):
    out = _ok(cli("--help", cwd=tmp_path))
    for command in ("models", "inspect", "plan", "place", "run", "draw", "report", "demo"):
        assert command in out
    for command in ("plan", "run", "draw", "report"):
        assert "usage: placement " + command in _ok(cli(command, "--help", cwd=tmp_path))


@pytest.mark.slow
def test_plan_then_place_with_the_plan(work):
    out = _ok(cli("plan", "mlp.onnx", "--devices", "2", "--cost", "flops", "-o", "plan.json", cwd=work))
    assert "lower bound" in out and "cuda:1" in out
    plan = pl.Plan.load(work / "plan.json")
    assert {d.device for d in plan.devices} == {"cuda:0", "cuda:1"}
    assert not (work / "placed.onnx").exists()  # plan writes no model
    out = _ok(cli("place", "mlp.onnx", "--plan", "plan.json", "-o", "placed.onnx", cwd=work))
    placed = pl.load(work / "placed.onnx")
    pl.verify(placed)
    for op in placed.ops:
        if not op.is_copy:
            assert str(op.device) == plan.assignment[op.name]


@pytest.mark.slow
def test_place_auto_with_budgets_prints_its_plan(work):
    out = _ok(cli("place", "mlp.onnx", "--auto", "--max-memory", "0=2GiB,1=6GiB", "-o", "p.onnx", cwd=work))
    assert "plan (throughput" in out and "lower bound" in out and "6.0 GiB" in out
    assert "saved p.onnx" in out
    pl.verify(pl.load(work / "p.onnx"))


@pytest.mark.slow
def test_place_calibrated_times_stage_sessions(work):
    out = _ok(
        cli("place", "mlp.onnx", "--calibrate", "--cost", "time", "--devices", "2", "-o", "c.onnx", cwd=work)
    )
    assert "plan (throughput, cost=time)" in out and "saved c.onnx" in out
    pl.verify(pl.load(work / "c.onnx"))  # (the tiny mlp is best left on one device: copies cost more)


@pytest.mark.slow
def test_calibrate_for_torch_times_lowered_stages(work):
    args = ("--calibrate", "--runtime", "torch", "--cost", "time", "--devices", "2", "-o", "p.json")
    assert "saved p.json" in _ok(cli("plan", "mlp.onnx", *args, cwd=work))
    assert json.loads((work / "p.json").read_text())["runtime"] == "torch"


@pytest.mark.slow
def test_calibrate_needs_measured_costs(work):
    result = cli("plan", "mlp.onnx", "--calibrate", "--cost", "flops", "-o", "p.json", cwd=work)
    assert result.returncode == 2 and "--calibrate" in result.stderr and "--cost time" in result.stderr
    assert not (work / "p.json").exists()


@pytest.mark.slow
def test_run_a_placed_file_matches_torch(work, files):
    out = _ok(
        cli(
            "run",
            "mlp_placed.onnx",
            "--input",
            "input=x.npy",
            "--output",
            "out.npz",
            "--repeat",
            "3",
            "--device-map",
            "0=cpu,1=cpu",
            cwd=work,
        )
    )
    assert "where each stage ran" in out and "latency: median" in out and "samples/s" in out
    assert "precision: fp32 (TF32 off), rtol=0.0001, atol=0.0001" in out
    assert "\r" not in out and "\x1b[" not in out  # no progress bars or colours in a pipe
    with np.load(work / "out.npz") as saved:
        (name,) = saved.files
        np.testing.assert_allclose(saved[name], np.load(files / "mlp_expected.npy"), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_run_chunks_names_an_input_without_a_batch_axis(work):
    """(Pipelining a dynamic batch through the command: tests/test_cli_inputs.py.)"""
    result = cli("run", "mlp_placed.onnx", "--input", "x.npy", "--chunks", "2", "--repeat", "1", cwd=work)
    assert result.returncode == 2 and "batch axis" in result.stderr and "'input'" in result.stderr
    errors = [line for line in result.stderr.strip().splitlines() if not line.startswith("WARNING")]
    assert len(errors) == 1 and errors[0].startswith("error:")


@pytest.mark.slow
def test_inspect_a_torchscript_export_shows_scopes_and_parameters(work):
    out = _ok(cli("inspect", "resnet_ts.onnx", cwd=work))
    assert "ops per module scope" in out and "layer1.0" in out and "layer2.0" in out
    assert "where parameters live" in out and "fc.weight" in out
    data = json.loads(_ok(cli("inspect", "resnet_ts.onnx", "--json", "--depth", "1", cwd=work)))
    scopes = {row["scope"]: row["ops"] for row in data["scopes"]}
    assert scopes["layer1"] == {"cuda:0": 5}
    assert sum(n for per in scopes.values() for n in per.values()) == data["devices"][0]["ops"]
    assert all(p["device"] == "cuda:0" for p in data["parameters"])


@pytest.mark.slow
def test_another_exporters_file_places_runs_and_draws(work, files):
    _ok(cli("place", "resnet_ts.onnx", "--auto", "--devices", "2", "-o", "r.onnx", cwd=work))
    out = _ok(
        cli("run", "r.onnx", "--input", "image=image.npy", "--output", "r.npz", "--repeat", "1", cwd=work)
    )
    assert "cuda:1" in out
    with np.load(work / "r.npz") as saved:
        np.testing.assert_allclose(saved[saved.files[0]], np.load(files / "resnet_expected.npy"), atol=1e-4)
    out = _ok(cli("draw", "r.onnx", "-o", "r.svg", cwd=work))
    written = work / ("r.svg" if dot_available() else "r.dot")
    assert written.exists() and "copy edges" in out
    if dot_available():
        svg = written.read_text()
        assert svg.count('class="node op dev_cuda_0"') + svg.count('class="node op dev_cuda_1"') == 16
        assert "cluster_layer1" in svg or "layer1" in svg


@pytest.mark.slow
def test_draw_and_report_a_zoo_model(work):
    out = _ok(
        cli(
            "draw", "mlp", "--devices", "3", "--collapse", "yes", "--max-nodes", "20", "-o", "g.png", cwd=work
        )
    )
    assert "cuda:2" in out and "collapsed to" in out
    if dot_available():
        assert (work / "g.png").read_bytes()[:4] == b"\x89PNG"
    out = _ok(
        cli("report", "mlp", "--devices", "2", "--max-memory", "0=1MiB,1=1MiB", "-o", "r.html", cwd=work)
    )
    page = (work / "r.html").read_text()
    assert "saved r.html" in out and "lower bound" in page and "1.0 MiB" in page
    assert "data:image/png;base64," in page and "<script" not in page


ERRORS = [
    (["inspect", "no-such-model"], "no-such-model"),
    (["plan", "mlp.onnx", "--devices", "2", "-o", "plan.txt"], "plan.txt"),
    (["plan", "mlp_placed.onnx", "-o", "plan.json"], "already has copies"),
    (["place", "mlp.onnx", "--max-memory", "0=2GiB,1", "-o", "p.onnx"], "--max-memory"),
    (["place", "mlp.onnx", "--max-memory", "0=1KiB,1=1KiB", "-o", "p.onnx"], "budget"),
    (["place", "mlp.onnx", "--max-memory", "0=lots", "-o", "p.onnx"], "lots"),
    (["place", "mlp.onnx", "--plan", "missing.json", "-o", "p.onnx"], "missing.json"),
    (["place", "mlp.onnx", "--devices", "0", "-o", "p.onnx"], "--devices"),
    (["place", "mlp.onnx", "--devices", "two", "-o", "p.onnx"], "--devices"),
    (["place", "mlp.onnx", "-o", "missing/p.onnx"], "missing"),
    (["run", "mlp_placed.onnx", "--input", "input=gone.npy", "--output", "o.npz"], "gone.npy"),
    (["run", "mlp_placed.onnx", "--input", "tokens=x.npy", "--output", "o.npz"], "tokens"),
    (["run", "mlp_placed.onnx", "--output", "o.npz"], "--input"),
    (["run", "mlp_placed.onnx", "--input", "x.npy", "--output", "o.txt"], "o.txt"),
    (["run", "mlp_placed.onnx", "--input", "x.npy", "--device-map", "0=tpu", "--output", "o.npz"], "tpu"),
    (["run", "gone.onnx", "--input", "x.npy", "--output", "o.npz"], "gone.onnx"),
    (["draw", "mlp.onnx", "-o", "m.jpeg"], ".jpeg"),
    (["report", "mlp.onnx", "-o", "r.pdf"], "r.pdf"),
    (["report", "mlp_placed.onnx", "--devices", "2", "-o", "r.html"], "already placed"),
]


@pytest.mark.parametrize(
    ("argv", "names"), ERRORS, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in enumerate(ERRORS)]
)
def test_errors_are_one_line_exit_2_and_write_nothing(work, argv, names, monkeypatch, capsys):
    """In process (the entry point itself is exercised by every test above, and by the first case
    here through a subprocess): a fresh interpreter per case would add seconds each."""
    from placement.cli import main

    before = sorted(p.name for p in work.iterdir())
    if argv is ERRORS[0][0]:
        result = cli(*argv, cwd=work)
        status, err = result.returncode, result.stderr
    else:
        monkeypatch.chdir(work)
        try:
            status = main(argv)
        except SystemExit as usage_error:  # argparse exits on a usage error, as the script would
            status = usage_error.code
        err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1, err
    assert "error" in lines[0] and names in lines[0], lines[0]
    assert sorted(p.name for p in work.iterdir()) == before
