"""Shared test helpers for pictures: placed zoo models, SVG parsing, headless Chromium screenshots."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import placement as pl

SVG = "{http://www.w3.org/2000/svg}"


def placed(model: pl.Model, devices: int = 2, *, copies: bool = True) -> pl.Model:
    """``model`` (in place) with its activations split into ``devices`` equal runs (Caffe2 shifts)."""
    acts = pl.get_activation_blobs(model)
    for k in range(devices - 1, 0, -1):
        start = len(acts) * k // devices
        pl.shift_activation_devices(model, acts[start:], {model.device_of(acts[start]): k})
    if copies:
        pl.inject_cross_device_copies(model)
    return model


def svg_boxes(svg: str) -> list[tuple[str, str]]:
    """(class, fill colour) of every op box in an SVG written by ``pl.draw``."""
    root = ET.fromstring(svg)
    found = []
    for group in root.iter(f"{SVG}g"):
        classes = (group.get("class") or "").split()
        if "node" not in classes or "op" not in classes:
            continue
        shapes = (el for el in group.iter() if el.tag in (f"{SVG}path", f"{SVG}polygon"))
        shape = next((el for el in shapes if el.get("fill") != "none"), None)
        device = " ".join(c for c in classes if c.startswith("dev_"))
        found.append((device, shape.get("fill", "") if shape is not None else ""))
    return found


def svg_copy_edges(svg: str) -> list[str]:
    """The label texts of the copy edges of an SVG written by ``pl.draw``."""
    root = ET.fromstring(svg)
    labels = []
    for group in root.iter(f"{SVG}g"):
        classes = (group.get("class") or "").split()
        if "edge" in classes and "copy" in classes:
            labels.append(" ".join(t.text or "" for t in group.iter(f"{SVG}text")))
    return labels


def chromium() -> str | None:
    """The Chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(page: Path, out: Path, *, width: int = 1400, height: int = 2400) -> None:
    """Render ``page`` (SVG or HTML) in headless Chromium, offline, and save a PNG screenshot."""
    exe = chromium()
    assert exe is not None
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        result = subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={out}",
                page.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.exists(), f"chromium wrote no screenshot (rc {result.returncode}): {result.stderr[-2000:]}"


def colour_pixels(png: Path) -> Counter:
    """Pixel count per ``#rrggbb`` colour of a PNG."""
    from PIL import Image

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        counts = Counter(rgb.getdata())
    return Counter({"#{:02x}{:02x}{:02x}".format(*c): n for c, n in counts.items()})
