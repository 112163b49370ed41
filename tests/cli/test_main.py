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


@pytest.mark.slow
def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "placement.cli", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "inspect" in result.stdout


def _no_activation_model(path):
    import onnx
    from onnx import TensorProto, helper

    const = helper.make_node("Constant", [], ["y"], name="c", value_floats=[1.0, 2.0])
    graph = helper.make_graph([const], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.slow
def test_place_without_activations_is_one_line_and_exit_2(tmp_path):
    source = tmp_path / "const.onnx"
    _no_activation_model(source)
    result = subprocess.run(
        [sys.executable, "-m", "placement.cli", "place", str(source), "-o", str(tmp_path / "out.onnx")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "0 activations" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_every_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not onnx at all")
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    out = str(tmp_path / "o.onnx")
    cases = [
        (["inspect", str(garbage)], "garbage.onnx"),
        (["inspect", str(folder)], "folder.onnx"),
        (["inspect", "mlp", "--size", "huge"], "huge"),
        (["place", "mlp", "--devices", "0", "-o", out], "devices"),
        (["place", "mlp", "--devices", "2", "-o", str(tmp_path / "no" / "o.onnx")], "does not exist"),
        (["place", "mlp", "--devices", "2", "-o", "/dev/null"], "not a regular file"),
        (["place", "mlp", "--devices", "2", "-o", str(folder)], "folder"),
        (["place", str(garbage), "-o", out], "garbage.onnx"),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.onnx", "garbage.onnx"]


def test_place_auto_prints_its_plan(tmp_path, capsys):
    path = tmp_path / "auto.onnx"
    assert main(["place", "mlp", "--auto", "--devices", "2", "--cost", "flops", "-o", str(path)]) == 0
    assert "bottleneck" in capsys.readouterr().out.lower() and path.exists()
