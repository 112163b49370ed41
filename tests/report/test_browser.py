"""The pictures as a user sees them: rendered by headless Chromium (offline), checked by colour."""

from __future__ import annotations

import pytest

import placement as pl
from placement.report.colours import COPY_EDGE_COLOUR, DEVICE_PALETTE, device_colour
from placement.report.draw import dot_available
from tests.report.helpers import chromium, colour_pixels, placed, screenshot

pytestmark = [
    pytest.mark.skipif(
        chromium() is None,
        reason="Chromium is not installed (Debian: apt-get install chromium; scripts/setup.sh as root)",
    ),
    pytest.mark.skipif(not dot_available(), reason="Graphviz 'dot' is not installed"),
]


def test_svg_screenshot_shows_each_device_in_its_colour(tmp_path, exported):
    model = placed(exported("gpt")[0], 3)
    drawing = pl.draw(model, tmp_path / "placed.svg", collapse=True, max_nodes=30)
    shot = tmp_path / "svg.png"
    screenshot(drawing.path, shot, width=1400, height=2000)
    pixels = colour_pixels(shot)
    for device in ("cuda:0", "cuda:1", "cuda:2"):
        assert pixels[device_colour(device)] > 2000, (device, pixels.most_common(8))
    for unused in DEVICE_PALETTE[3:]:
        assert pixels[unused] == 0
    assert sum(n for c, n in pixels.items() if c == COPY_EDGE_COLOUR) > 200  # copy edges


def test_html_report_screenshot_shows_devices_charts_and_graph(tmp_path, exported):
    model = exported("gpt")[0]
    plan = pl.auto_place(model, devices=2, cost="flops")
    pl.inject_cross_device_copies(model)
    report = pl.write_report(model, tmp_path / "report.html", plan=plan)
    shot = tmp_path / "report.png"
    screenshot(report.path, shot, width=1200, height=3000)
    pixels = colour_pixels(shot)
    for device in ("cuda:0", "cuda:1"):
        assert pixels[device_colour(device)] > 20000, (device, pixels.most_common(8))
    assert pixels[device_colour("cuda:2")] == 0
