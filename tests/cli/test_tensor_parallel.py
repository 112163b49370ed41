"""``--tensor-parallel`` of ``placement plan``, ``place`` and ``report`` (in process)."""

from __future__ import annotations

import pytest

import placement as pl
from placement.cli import main
from placement.graph.nodes import collective_tag


def test_plan_then_place_split(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "gpt", "--devices", "2", "--tensor-parallel", "2", "-o", "p.json"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2" in out and "collectives" in out
    plan = pl.Plan.load(tmp_path / "p.json")
    assert plan.tensor_parallel == [2] and plan.cost_kind == "time"  # FLOPs at the device's speed
    assert main(["place", "gpt", "--plan", "p.json", "-o", "t.onnx"]) == 0
    model = pl.load(tmp_path / "t.onnx")
    assert sum(collective_tag(n) is not None for n in model.graph) > 0
    pl.verify(model)


def test_plan_then_place_stages_split_inside_a_pipeline(tmp_path, monkeypatch, capsys):
    """--devices 4 --tensor-parallel 2: two stages of two devices; the title names the groups."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "gpt", "--devices", "4", "--tensor-parallel", "2", "-o", "p.json"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tensor parallel 2" in out and "stage groups cuda:0,cuda:1 | cuda:2,cuda:3" in out
    plan = pl.Plan.load(tmp_path / "p.json")
    assert plan.tensor_parallel == [2, 2] and plan.groups == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert main(["place", "gpt", "--plan", "p.json", "-o", "t.onnx"]) == 0
    model = pl.load(tmp_path / "t.onnx")
    pl.verify(model)
    groups = {tuple(collective_tag(n)["group"]) for n in model.graph if collective_tag(n) is not None}
    assert groups == {("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")}


def test_auto_for_latency_and_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--devices", "2", "--tensor-parallel", "auto", "--objective", "latency"]
    assert main(["report", "gpt", *argv, "-o", "r.html"]) == 0
    assert "chosen from 1:" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["two", "1.5"])
def test_a_bad_degree_is_refused(value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "gpt", "--tensor-parallel", value, "-o", "p.json"])
    assert exit_.value.code == 2 and "expected 'auto' or a degree" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
