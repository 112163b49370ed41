"""Scope metadata from a file is untrusted: ``.``, ``..`` or ``.a`` never make draw or report recurse."""

from __future__ import annotations

import pytest

import placement as pl
from placement.graph.nodes import SCOPE_KEY, node_scope
from placement.report.dot import scope_of
from tests.graph.builders import mlp_graph


def _scoped(scopes: list[str]) -> pl.Model:
    model = mlp_graph(layers=2)
    for node, scope in zip(model.graph, scopes * len(model.ops)):
        node.metadata_props[SCOPE_KEY] = scope
    return model


@pytest.mark.parametrize("scope, expected", [(".", None), ("..", None), (".a", "a"), ("a..b.", "a.b")])
def test_scopes_lose_empty_components(scope, expected):
    node = next(iter(_scoped([scope]).graph))
    assert node_scope(node) == expected and scope_of(node) == expected


def test_draw_and_report_handle_odd_scopes(tmp_path):
    model = _scoped([".", "..", ".a", "a..b", "a.b.", "..."])
    drawing = pl.draw(model, tmp_path / "m.dot", collapse=False)
    assert drawing.path is not None
    pl.draw(model, tmp_path / "collapsed.dot", collapse=True)
    pl.write_report(model, tmp_path / "report.html")
    assert (tmp_path / "report.html").stat().st_size > 0


def test_path_like_op_names_with_dots_are_clean():
    import onnx_ir as ir

    assert scope_of(ir.Node("", "Relu", [], name="/./../a/Relu")) == "a"
