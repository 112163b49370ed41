from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import placement as pl
from placement.analysis.dependence import copy_origin, load_time_values
from placement.report.colours import COPY_EDGE_COLOUR, DEVICE_PALETTE, device_colour
from placement.report.draw import dot_available
from tests.report.helpers import placed, svg_boxes, svg_copy_edges

needs_dot = pytest.mark.skipif(not dot_available(), reason="Graphviz 'dot' is not installed")


@needs_dot
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_svg_has_one_box_per_op_in_its_device_colour(tmp_path, name, exported):
    model = placed(exported(name)[0], 2)
    drawing = pl.draw(model, tmp_path / "placed.svg")
    assert drawing.rendered and drawing.path == tmp_path / "placed.svg" and not drawing.collapsed
    svg = drawing.path.read_text()
    boxes = svg_boxes(svg)
    expected = {f"dev_cuda_{r.device.index}": r.ops for r in pl.summary(model).rows}
    assert Counter(cls for cls, _ in boxes) == expected
    for cls, fill in boxes:
        assert fill == device_colour(int(cls.rsplit("_", 1)[1]))
    # every dynamic copy is a labelled red edge; copies are edges, never boxes
    fixed = load_time_values(model.graph)  # recomputed where read: no per-step copy edge
    sources = {
        op.inputs[0]
        for op in model.ops
        if op.is_copy and not op.is_static_copy and copy_origin(model.value(op.inputs[0])) not in fixed
    }
    labels = svg_copy_edges(svg)
    assert len(labels) == drawing.copy_edges > 0
    assert {label.split()[0] for label in labels} == sources
    assert all(label.split()[-1] in ("B", "KiB", "MiB") for label in labels)
    assert COPY_EDGE_COLOUR in svg


def test_draw_leaves_the_model_unchanged(exported):
    model = placed(exported("mlp")[0], 2)
    before = (model.device_state(), [op.name for op in model.ops], model.outputs)
    pl.draw(model, None, collapse=True)
    pl.draw(model, None, collapse=False)
    assert (model.device_state(), [op.name for op in model.ops], model.outputs) == before


def test_cross_device_edges_are_marked_without_copies(exported):
    model = placed(exported("mlp")[0], 2, copies=False)
    drawing = pl.draw(model, None)
    assert drawing.copy_edges == 1 and f'color="{COPY_EDGE_COLOUR}"' in drawing.dot


def _chain_model(blocks: int, per_block: int) -> onnx.ModelProto:
    """A 2,000-op chain named like the TorchScript exporter names ops (/blocks/blocks.3/mlp/Relu)."""
    nodes, previous = [], "x"
    for b in range(blocks):
        for k in range(per_block):
            sub = "mlp" if k % 2 else "attn"
            out = f"v{b}_{k}"
            op = "Relu" if k % 3 else "Neg"
            nodes.append(helper.make_node(op, [previous], [out], name=f"/blocks/blocks.{b}/{sub}/{op}_{k}"))
            previous = out
    nodes.append(helper.make_node("Identity", [previous], ["y"], name="/head/Identity"))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


@needs_dot
def test_a_2000_op_model_collapses_to_readable_module_boxes(tmp_path):
    model = pl.load(_chain_model(100, 20))
    assert len(model.ops) == 2001
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    pl.inject_cross_device_copies(model)
    drawing = pl.draw(model, tmp_path / "big.svg")
    assert drawing.collapsed and drawing.ops == 2001 and drawing.boxes <= 120
    boxes = svg_boxes(drawing.path.read_text())
    assert len(boxes) == drawing.boxes
    assert {fill for _, fill in boxes} == {DEVICE_PALETTE[0], DEVICE_PALETTE[1]}
    assert drawing.copy_edges == 1
    assert drawing.ops_per_device == {"cuda:0": 1000, "cuda:1": 1001}


def test_without_dot_the_dot_source_is_written_with_a_note(tmp_path, monkeypatch, exported):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    drawing = pl.draw(placed(exported("mlp")[0], 2), tmp_path / "placed.svg")
    assert not drawing.rendered and drawing.format == "dot"
    assert drawing.path == tmp_path / "placed.dot" and not (tmp_path / "placed.svg").exists()
    assert drawing.path.read_text().startswith("digraph")
    assert "graphviz" in (drawing.note or "") and "placed.dot" in (drawing.note or "")


@needs_dot
def test_png_and_dot_outputs(tmp_path, exported):
    model = placed(exported("mlp")[0], 2)
    assert pl.draw(model, tmp_path / "p.png").path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pl.draw(model, tmp_path / "p.gv").path.read_text().startswith("digraph")


def test_bad_targets_are_clear_errors_and_write_nothing(tmp_path, exported):
    model = placed(exported("mlp")[0], 2)
    with pytest.raises(pl.ModelSaveError, match=r"\.jpeg"):
        pl.draw(model, tmp_path / "p.jpeg")
    with pytest.raises(pl.ModelSaveError, match="does not exist"):
        pl.draw(model, tmp_path / "missing" / "p.svg")
    with pytest.raises(pl.PlanError, match="max_nodes"):
        pl.draw(model, tmp_path / "p.svg", max_nodes=0)
    assert list(tmp_path.iterdir()) == []


def test_device_colours_are_stable_and_distinct():
    colours = [device_colour(k) for k in range(len(DEVICE_PALETTE))] + [device_colour("cpu")]
    assert len(set(colours)) == len(colours)
    assert device_colour("cuda:3") == device_colour(3) == DEVICE_PALETTE[3]
    assert np.all([c.startswith("#") and len(c) == 7 for c in colours])


def test_the_readme_shows_a_picture_drawn_by_the_project():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert "](docs/placed_gpt.svg)" in (root / "README.md").read_text()
    boxes = svg_boxes((root / "docs" / "placed_gpt.svg").read_text())
    assert {fill for _, fill in boxes} == {device_colour(0), device_colour(1)}
