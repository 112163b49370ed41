"""Streamed weights in the summary, the picture and the HTML report."""

from __future__ import annotations

import placement as pl
from placement.report.colours import STREAMED_COLOUR


def _streamed_mlp(exported):
    model, _, _ = exported("mlp")
    pl.stream_parameters(model, ["fc2"], window="8KiB")
    pl.inject_cross_device_copies(model)
    return model


def test_summary_counts_streamed_weights(exported):
    model = _streamed_mlp(exported)
    streamed = sum(model.parameters[name].nbytes for name in model.streamed)
    report = pl.summary(model)
    gpu, host = report.row("cuda:0"), report.row("cpu")
    assert gpu.streamed_copies == 2 and gpu.streamed_bytes == streamed
    assert host.param_bytes == streamed and host.streamed_bytes == streamed and host.ops == 0
    assert gpu.static_copies == 0 and gpu.recv_bytes == 0  # neither static nor activation traffic
    assert "streamed" in str(report)


def test_draw_marks_readers_of_streamed_weights(exported):
    model = _streamed_mlp(exported)
    drawing = pl.draw(model, None, collapse=False)
    assert STREAMED_COLOUR in drawing.dot and "streamed from the host every run" in drawing.dot
    assert "fc2.weight" in drawing.dot
    plain, _, _ = exported("mlp")
    assert STREAMED_COLOUR not in pl.draw(plain, None).dot


def test_html_report_lists_streamed_weights(exported, tmp_path):
    model = _streamed_mlp(exported)
    pl.write_report(model, tmp_path / "r.html")
    text = (tmp_path / "r.html").read_text()
    assert "Weights streamed from the host" in text and "fc2.bias" in text and "8.0 KiB" in text
