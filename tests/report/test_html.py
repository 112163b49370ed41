from __future__ import annotations

import base64
import re

import pytest

import placement as pl
from placement.report.colours import device_colour
from placement.report.draw import dot_available
from placement.report.html import copy_traffic
from tests.report.helpers import placed

EXTERNAL = re.compile(
    r"""(?:src|href)\s*=\s*["']?\s*(?:https?:|//|file:)|<link\b|<script\b|@import|url\(""", re.I
)


def _planned_gpt(exported):
    model = exported("gpt")[0]
    plan = pl.auto_place(model, max_memory={0: "150KiB", 1: "1MiB"}, cost="size")
    pl.inject_cross_device_copies(model)
    return model, plan


def test_report_is_one_self_contained_page(tmp_path, exported):
    model, plan = _planned_gpt(exported)
    report = pl.write_report(model, tmp_path / "report.html", plan=plan)
    page = report.path.read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "report.html"]
    assert not EXTERNAL.search(page), EXTERNAL.search(page)
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3  # time and memory, bytes per cut, planner against the bound
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    for row in plan.devices:
        assert row.device in page and device_colour(row.device) in page
    assert "lower bound" in page and "150.0 KiB" in page  # the budget
    if dot_available():
        assert page.count("<svg") == 1 and 'class="node op dev_cuda_1"' in page
    else:
        assert "digraph" in page and "Graphviz" in page


def test_report_without_a_plan_has_no_planner_section(tmp_path, exported):
    model = placed(exported("resnet")[0], 2)
    report = pl.write_report(model, tmp_path / "r.html")
    page = report.path.read_text()
    assert "Planner" not in page and "Per device" in page
    assert report.traffic == copy_traffic(model)
    for (src, dst), nbytes in report.traffic.items():
        assert f"{src}</td>" in page and f"{dst}</td>" in page and nbytes > 0


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
def test_copy_traffic_agrees_with_the_summary(name, exported):
    model = placed(exported(name)[0], 3)
    traffic = copy_traffic(model)
    summary = pl.summary(model)
    for row in summary.rows:
        device = str(row.device)
        assert sum(n for (s, _), n in traffic.items() if s == device) == row.sent_bytes
        assert sum(n for (_, d), n in traffic.items() if d == device) == row.recv_bytes


def test_report_errors_write_nothing(tmp_path, exported):
    with pytest.raises(pl.ModelSaveError, match="does not exist"):
        pl.write_report(placed(exported("mlp")[0], 2), tmp_path / "nope" / "r.html")
    assert list(tmp_path.iterdir()) == []
