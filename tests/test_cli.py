from __future__ import annotations

import subprocess
import sys

import pytest

import placement as pl
from placement.cli import build_parser, main


@pytest.mark.parametrize("argv", [[], ["models"], ["inspect"], ["place"], ["demo"]])
def test_help_on_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: placement" in out and "--help" in out


def test_parser_lists_commands():
    text = build_parser().format_help()
    for command in ("models", "inspect", "place", "demo"):
        assert command in text


def test_models_lists_the_zoo(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("mlp", "resnet", "gpt", "unet"):
        assert name in out


def test_inspect_builtin_and_file(tmp_path, capsys):
    assert main(["inspect", "mlp"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0" in out
    path = tmp_path / "p.onnx"
    assert main(["place", "mlp", "--devices", "2", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cuda:0" in out and "cuda:1" in out
    placed = pl.load(path)
    assert placed.devices == [pl.Device("cuda", 0), pl.Device("cuda", 1)]
    pl.verify(placed)


def test_bad_model_is_a_clear_error(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "gpt" in err


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "gone.onnx")]) == 2
    assert "gone.onnx" in capsys.readouterr().err


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "placement.cli", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "inspect" in result.stdout


def test_place_auto_prints_its_plan(tmp_path):
    path = tmp_path / "auto.onnx"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "placement.cli",
            "place",
            "mlp",
            "--auto",
            "--devices",
            "2",
            "--cost",
            "flops",
            "-o",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "bottleneck" in done.stdout.lower() and path.exists()
