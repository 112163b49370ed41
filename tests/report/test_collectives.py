"""Collectives in pictures and the report: tiny GPT split over 2 devices."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

import placement as pl
from placement.report.collectives import collective_rows
from placement.report.colours import COLLECTIVE_COLOUR, device_colour
from placement.report.draw import dot_available
from tests.conftest import export_once

needs_dot = pytest.mark.skipif(not dot_available(), reason="Graphviz 'dot' is not installed")

#: tiny GPT: 2 x 8 tokens of width 32 in float32; logits over a vocabulary of 64
HIDDEN, LOGITS = 2 * 8 * 32 * 4, 2 * 8 * 64 * 4


@pytest.fixture(scope="module")
def planned():
    """tiny GPT split over 2 devices by the planner, and its plan"""
    model = export_once("gpt")[0].copy()  # the session's tiny GPT export
    plan = pl.auto_place(model, devices=2, tensor_parallel=2, cost="flops", links="nvlink")
    return model, plan


@pytest.fixture(scope="module")
def split(planned):
    return planned[0]


def test_rows_give_each_collective_and_the_bytes_each_device_reads(split):
    rows = collective_rows(split)
    assert [r.kind for r in rows] == ["all_reduce"] * 5 + ["all_gather"]
    for r in rows[:5]:  # each device reads the other's partial sum, whole
        assert r.nbytes == HIDDEN and r.received == {"cuda:0": HIDDEN, "cuda:1": HIDDEN}
        assert r.group == ["cuda:0", "cuda:1"] and len(r.nodes) == 2
    assert rows[-1].nbytes == LOGITS and rows[-1].received == {"cuda:0": LOGITS // 2}  # the other half
    assert [r.scope for r in rows[1:3]] == ["blocks.0.attn.c_proj", "blocks.0.mlp.c_proj"]  # row parallel


@pytest.mark.parametrize("collapse", [False, True])
def test_dot_draws_collectives_as_labelled_hexagons(split, collapse):
    drawing = pl.draw(split, None, collapse=collapse)
    nodes = [line for line in drawing.dot.splitlines() if "shape=hexagon" in line]
    assert len(nodes) == 11  # a node per device per all-reduce; the logits gathered on cuda:0 only
    assert all(f'color="{COLLECTIVE_COLOUR}"' in line for line in nodes)
    assert sum("all-reduce" in line and "2.0 KiB" in line for line in nodes) == 10
    assert sum("all-gather" in line and "4.0 KiB" in line for line in nodes) == 1
    assert "tensor-parallel collective (kind, bytes of its value): 6 collectives, 11 nodes" in drawing.dot


@needs_dot
def test_svg_hexagons_keep_the_device_colour(split, tmp_path):
    drawing = pl.draw(split, tmp_path / "split.svg", collapse=False)
    root = ET.fromstring(drawing.path.read_text())
    found = []
    for group in root.iter("{http://www.w3.org/2000/svg}g"):
        classes = (group.get("class") or "").split()
        if "collective" in classes:
            polygon = next(group.iter("{http://www.w3.org/2000/svg}polygon"))
            device = next(c for c in classes if c.startswith("dev_cuda_"))
            found.append((polygon.get("fill"), polygon.get("stroke"), device_colour(int(device[-1]))))
    assert len(found) == 11
    assert all(fill == colour and stroke == COLLECTIVE_COLOUR for fill, stroke, colour in found)


def test_report_lists_collectives_with_bytes_per_device(planned, tmp_path):
    model, plan = planned
    report = pl.write_report(model, tmp_path / "r.html", plan=plan)
    text = (tmp_path / "r.html").read_text()
    # the planner's section says the degree and the stages
    assert "Tensor parallel 2, stage groups cuda:0,cuda:1, 6 collectives" in text
    assert "[[&#x27;cuda:0&#x27;, &#x27;cuda:1&#x27;]]" in text
    assert len(report.collectives) == 6 and "Tensor-parallel collectives" in text
    assert "5 all-reduces" in text and "1 all-gathers" in text
    assert text.count('<tr class="collective">') == 6
    assert "<th>read by cuda:0</th><th>read by cuda:1</th>" in text
    totals = re.search(r"<b>per step</b></td><td>([^<]+)</td><td>([^<]+)</td>", text)
    assert totals is not None and totals.groups() == ("12.0 KiB", "10.0 KiB")  # 5 x 2 KiB (+ 4 KiB / 2)
