"""``place``, ``plan``, ``draw`` and ``report`` take ``--input``/``--dim`` as ``run`` does: a
dynamic-batch model plans, profiles (``--cost time``, ``--calibrate``) and is drawn at the stated
sizes; ``run`` reads one ``.npz`` with every input by name and refuses an input given twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import placement as pl
from placement.cli import main
from placement.models import resnet

pytestmark = pytest.mark.xdist_group("cli_planner_inputs")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """An unplaced tiny resnet exported with a dynamic batch, and an 8-image batch for it."""
    root = tmp_path_factory.mktemp("dyn")
    net, _ = resnet.build("tiny")
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},)).save(root / "cnn.onnx")
    np.save(root / "x8.npy", x.numpy())
    return root


def test_budgets_count_the_stated_batch(files, tmp_path, capsys):
    out = tmp_path / "o.onnx"
    base = [
        "place",
        str(files / "cnn.onnx"),
        "--max-memory",
        "0=20KiB,1=40KiB",
        "--cost",
        "flops",
        "-o",
        str(out),
    ]
    for extra in (["--dim", "batch=8"], ["--input", f"x={files / 'x8.npy'}"]):
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "smallest uniform budget" in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
    assert main([*base[:2], "--max-memory", "0=200KiB,1=200KiB", *base[4:], "--dim", "batch=8"]) == 0
    assert "sizes at batch=8" in capsys.readouterr().out
    assert pl.planning.dims.stored_dims(pl.load(out)) == {"batch": 8}


def test_time_cost_and_calibration_profile_a_dynamic_model(files, tmp_path, capsys):
    model = str(files / "cnn.onnx")
    assert main(["place", model, "--auto", "--cost", "time", "-o", str(tmp_path / "t.onnx")]) == 0
    assert "cost=time" in capsys.readouterr().out
    argv = ["place", model, "--cost", "time", "--calibrate", "--input", str(files / "x8.npy")]
    assert main([*argv, "-o", str(tmp_path / "c.onnx")]) == 0
    assert "sizes at batch=8" in capsys.readouterr().out


def test_plan_draw_and_report_at_a_stated_batch(files, tmp_path, capsys):
    model = str(files / "cnn.onnx")
    plan_file = tmp_path / "plan.json"
    assert main(["plan", model, "--devices", "2", "--dim", "batch=8", "-o", str(plan_file)]) == 0
    assert json.loads(plan_file.read_text())["dims"] == {"batch": 8}

    placed = tmp_path / "p.onnx"
    assert main(["place", model, "--plan", str(plan_file), "-o", str(placed)]) == 0
    dots = {}
    for batch in ("1", "8"):
        target = tmp_path / f"b{batch}.dot"
        assert main(["draw", str(placed), "-o", str(target), "--dim", f"batch={batch}"]) == 0
        dots[batch] = target.read_text()
    sizes = {b: re.findall(r'label="[^"]*\n([0-9.]+ (?:B|KiB|MiB))" class=copy', d) for b, d in dots.items()}
    assert sizes["8"] and "0 B" not in sizes["8"] and sizes["8"] != sizes["1"]
    assert main(["draw", str(placed), "-o", str(tmp_path / "same.dot")]) == 0  # the planned sizes by default
    assert (tmp_path / "same.dot").read_text() == dots["8"]

    report = tmp_path / "r.html"
    assert main(["report", model, "--devices", "2", "--dim", "batch=8", "-o", str(report)]) == 0
    assert main(["report", model, "--devices", "2", "--dim", "seq=8", "-o", str(report)]) == 2
    assert "'seq' is not a symbolic dimension" in capsys.readouterr().err


def test_run_reads_an_npz_and_refuses_an_input_given_twice(files, tmp_path, capsys):
    placed = tmp_path / "p.onnx"
    assert main(["place", str(files / "cnn.onnx"), "--devices", "2", "-o", str(placed)]) == 0
    x = np.load(files / "x8.npy")
    np.savez(tmp_path / "inputs.npz", x=x)
    out = tmp_path / "out.npz"
    argv = ["run", str(placed), "--device-map", "cpu", "--repeat", "1"]
    assert main([*argv, "--input", str(tmp_path / "inputs.npz"), "-o", str(out)]) == 0
    net, _ = resnet.build("tiny")
    with torch.no_grad():
        np.testing.assert_allclose(
            next(iter(np.load(out).values())), net(torch.from_numpy(x)).numpy(), atol=1e-4
        )
    capsys.readouterr()
    np.savez(tmp_path / "extra.npz", x=x, y=x)
    for bad, words in (
        (["--input", f"x={files / 'x8.npy'}", "--input", "x=random"], "'x' is given twice"),
        (["--input", str(tmp_path / "inputs.npz"), "--input", "x=random"], "'x' is given twice"),
        (["--input", str(tmp_path / "extra.npz")], "no input 'y'"),
    ):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


class _FixedInside(torch.nn.Module):
    """Marked dynamic on export, yet its reshape traces the batch of 2 into a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x, attention_mask):
        return self.fc(x.reshape(2, 12)) * attention_mask[:, :1].float()


def test_inspect_reads_the_real_sizes_and_suggests_a_0_1_mask(tmp_path, capsys):
    args = (torch.randn(2, 3, 4), torch.ones(2, 5, dtype=torch.int64))
    path = tmp_path / "ts.onnx"
    torch.onnx.export(
        _FixedInside(),
        args,
        str(path),
        dynamo=False,
        input_names=["x", "attention_mask"],
        dynamic_axes={"x": {0: "batch"}, "attention_mask": {0: "batch", 1: "seq"}},
    )
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "any size" not in out and "it ran at 2 but not at 3" in out
    recipe = next(line for line in out.splitlines() if "np.save('attention_mask.npy'" in line)
    assert "np.ones((2, 2), dtype='int64')" in recipe and "randint" not in recipe
    assert main(["run", str(path), "--random-inputs", "--repeat", "1", "-o", str(tmp_path / "o.npz")]) == 0
