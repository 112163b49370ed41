"""Pictures of a placed model: the operator graph coloured by device, through Graphviz.

:func:`draw` turns a :class:`placement.Model` into a Graphviz graph and renders it
with the ``dot`` program (SVG, PNG or PDF, chosen by the file suffix):

* one box per op, filled with its device's colour (:func:`placement.report.colours.device_colour`; the same
  colour for the same device in every picture and in the HTML report);
* cross-device copies are not boxes but **edges**: a bold dashed red edge from the
  op that produced the blob to the op that reads its copy, labelled with the blob
  and its size. They are the stage boundaries: every such edge crosses from one
  stage to the next. In a model without injected copies the same edges mark
  every cross-device edge. Copies of parameters (static, done once at load time)
  move nothing per step and are listed in the tooltip of the op reading them;
  values computed from parameters alone (a transposed weight) are recomputed where
  they are read, at load time: their cross-device edges are dotted, without bytes;
  an op reading *streamed* weights (parameters that live on the host and are copied
  every run, see :func:`placement.stream_parameters`) has a thick blue border
  (:data:`placement.report.colours.STREAMED_COLOUR`), a "streamed" line in its label and the weights in its
  tooltip; the legend counts streamed copies and their bytes per step;
* module scopes (``blocks.0.attn``) become nested clusters;
* graph inputs and outputs are ellipses; a legend (the graph's label) gives each
  device's colour, op count and stages.

Big graphs are collapsed (``collapse="auto"``: more than ``max_nodes`` ops) to one
box per module scope and device, at the deepest scope level that still gives at
most ``max_nodes`` boxes, so a 2,000-op model stays readable; copy edges between
boxes carry the summed bytes of the distinct blobs crossing.

Without ``dot`` (Graphviz is not installed) the DOT source is written next to the
requested file (``placed.dot``) and :attr:`Drawing.note` says how to render it.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
    >>> _ = pl.inject_cross_device_copies(model)
    >>> drawing = pl.draw(model, None)          # no file: just the DOT source
    >>> drawing.ops, drawing.copy_edges, drawing.collapsed
    (5, 1, False)
    >>> from placement.report.colours import device_colour
    >>> device_colour("cuda:1") in drawing.dot
    True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from placement.errors import ModelSaveError, PlacementError
from placement.graph.atomic import write_file
from placement.graph.model import Model
from placement.planning.dims import planned_dims
from placement.report.dot import DotBuilder

__all__ = ["draw", "Drawing", "FORMATS", "dot_available", "render_svg"]

log = logging.getLogger(__name__)


#: Picture formats by file suffix; ``dot``/``gv`` write the DOT source only.
FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf", ".dot": "dot", ".gv": "dot"}


@dataclasses.dataclass
class Drawing:
    """What :func:`draw` made.

    Attributes:
        dot: the DOT source.
        path: the file written (the ``.dot`` file when ``dot`` was missing), or None.
        format: ``"svg"``, ``"png"``, ``"pdf"`` or ``"dot"`` (what ``path`` holds).
        rendered: True when Graphviz rendered the picture.
        collapsed: True when ops were grouped into one box per module scope and device.
        boxes: boxes drawn (ops, or groups when collapsed), inputs/outputs excluded.
        ops: ops drawn (copies excluded: they are edges).
        copy_edges: copy (cut) edges drawn.
        ops_per_device: ops per device string.
        note: a line for the user (e.g. how to render the DOT file), or None.
    """

    dot: str
    path: Path | None
    format: str
    rendered: bool
    collapsed: bool
    boxes: int
    ops: int
    copy_edges: int
    ops_per_device: dict[str, int]
    note: str | None = None


def draw(
    model: Model,
    path: str | os.PathLike[str] | None,
    *,
    collapse: bool | str = "auto",
    max_nodes: int = 120,
    title: str | None = None,
    stages: bool = True,
    batch: int | Mapping[str, int] | None = None,
) -> Drawing:
    """Draw ``model``'s operator graph coloured by device (see the module docstring).

    Args:
        model: a :class:`placement.Model`, placed or not, copies injected or not. Not modified.
        path: the file to write; its suffix picks the format (``.svg``, ``.png``, ``.pdf``,
            ``.dot``). None writes nothing and returns the DOT source.
        collapse: ``"auto"`` (collapse when the model has more than ``max_nodes`` ops),
            True (always one box per module scope and device) or False (one box per op).
        max_nodes: most boxes a collapsed picture may have (and the ``"auto"`` threshold).
        title: the picture's title (default: the model's op and device counts).
        stages: name each device's stages in the legend (cuts the model into stages as
            the ONNX Runtime executor does; skipped when that fails).
        batch: the sizes of symbolic dimensions (a dynamic batch) in the bytes on copy
            edges: an int for every one, or a mapping symbol -> size; default the sizes
            the model was planned at, else 1 (see :mod:`placement.planning.dims`).

    Returns:
        A :class:`Drawing`. Without Graphviz's ``dot`` the DOT source goes to
        ``path.with_suffix(".dot")`` and ``Drawing.note`` says how to render it.

    Raises:
        ModelSaveError: unknown suffix, or the file cannot be written (nothing is
            left half-written).
        PlanError: ``collapse`` or ``max_nodes`` is malformed.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.from_torch(*gpt.build("tiny"))
        >>> d = pl.draw(model, None, collapse=True, max_nodes=10)
        >>> d.collapsed, d.boxes <= 10, d.ops == len(model.ops)
        (True, True, True)
    """
    from placement.errors import PlanError

    if collapse not in (True, False, "auto"):
        raise PlanError(f"collapse must be True, False or 'auto', got {collapse!r}")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise PlanError(f"max_nodes must be a positive integer, got {max_nodes!r}")
    target = Path(path) if path is not None else None
    fmt = "dot"
    if target is not None:
        fmt = FORMATS.get(target.suffix.lower(), "")
        if not fmt:
            raise ModelSaveError(
                f"cannot draw to {str(target)!r}: unknown picture format {target.suffix!r}; "
                f"use one of {', '.join(FORMATS)}"
            )
        if not target.parent.is_dir():
            raise ModelSaveError(
                f"cannot draw to {str(target)!r}: folder {str(target.parent)!r} does not exist"
            )

    builder = DotBuilder(model, dims=planned_dims(model, batch=batch))
    n_ops = len(builder.ops)
    collapsed = collapse is True or (collapse == "auto" and n_ops > max_nodes)
    stage_names = _stage_names(model) if stages else {}
    dot = builder.dot(collapsed=collapsed, max_nodes=max_nodes, title=title, stages=stage_names)
    drawing = Drawing(
        dot=dot,
        path=None,
        format="dot",
        rendered=False,
        collapsed=collapsed,
        boxes=builder.boxes,
        ops=n_ops,
        copy_edges=builder.copy_edges,
        ops_per_device={str(d): n for d, n in sorted(builder.per_device.items())},
    )
    if target is None:
        return drawing
    if fmt == "dot":
        write_file(target, dot.encode())
        drawing.path, drawing.format = target, "dot"
        return drawing
    data = _render(dot, fmt)
    if data is None:
        dot_path = target.with_suffix(".dot")
        write_file(dot_path, dot.encode())
        drawing.path, drawing.format = dot_path, "dot"
        drawing.note = (
            f"Graphviz 'dot' was not found, so the graph went to {dot_path} (DOT source); install "
            f"Graphviz (Debian: apt-get install graphviz; or bash scripts/setup.sh as root) and run "
            f"dot -T{fmt} {dot_path} -o {target}"
        )
        log.warning("%s", drawing.note)
        return drawing
    write_file(target, data)
    drawing.path, drawing.format, drawing.rendered = target, fmt, True
    log.info("drew %d ops (%d boxes) to %s", n_ops, builder.boxes, target)
    return drawing


def dot_available() -> bool:
    """True if Graphviz's ``dot`` program is on ``PATH``."""
    return shutil.which("dot") is not None


def render_svg(dot: str) -> str | None:
    """Render DOT source to SVG text with ``dot``; None when ``dot`` is missing."""
    data = _render(dot, "svg")
    return data.decode("utf-8") if data is not None else None


def _render(dot: str, fmt: str) -> bytes | None:
    import graphviz

    if not dot_available():
        return None
    try:
        return graphviz.Source(dot).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        return None
    except graphviz.CalledProcessError as err:  # a dot crash on our source is a bug worth naming
        stderr = (err.stderr or b"").decode(errors="replace").strip().splitlines()
        raise PlacementError(f"Graphviz dot failed: {stderr[-1] if stderr else err}") from err


def _stage_names(model: Model) -> dict[str, int]:
    """Op name -> stage index, as the ONNX Runtime executor cuts the model ({} on failure)."""
    from placement.runtime.stages import partition

    try:
        found = partition(model)
    except PlacementError as err:
        log.info("no stages in the picture: %s", err)
        return {}
    return {op: stage.index for stage in found for op in stage.ops}
