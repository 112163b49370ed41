"""``placement draw MODEL -o placed.svg``: the graph coloured by device.

Example:
    $ placement draw gpt --devices 2 -o placed.svg
"""

from __future__ import annotations

import argparse
from typing import Any

import placement as pl
from placement.cli.common import MODEL_HELP, SIZE_HELP, check_output, load_model_spec, step
from placement.cli.inputs import parse_dims
from placement.cli.placing import add_place_options, place_model, wants_placement


def add_parser(sub: Any) -> None:
    """Add ``placement draw`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "draw",
        help="draw the operator graph coloured by device (svg, png, pdf or dot)",
        description=(
            "Draw MODEL's operator graph with Graphviz: ops coloured by device, copies as red dashed "
            "edges labelled with their bytes, module scopes as clusters; big graphs collapse to one box "
            "per module and device. Place it first with --devices/--auto/--max-memory/--plan (as in "
            "'place'), or draw a placed .onnx as it is. Without Graphviz's dot, a .dot file is written."
        ),
        epilog="Example: placement draw gpt --devices 2 -o placed.svg | placement draw placed.onnx -o p.png",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    add_place_options(p)
    p.add_argument(
        "--collapse",
        default="auto",
        choices=["auto", "yes", "no"],
        help="one box per module scope and device (auto: when the graph has more than --max-nodes ops)",
    )
    p.add_argument("--max-nodes", type=int, default=120, help="most boxes when collapsed (default 120)")
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement draw`` with the parsed ``args``, printing to ``console``; the exit status."""
    from placement.report.draw import FORMATS

    target = check_output(args.output, list(FORMATS), "the picture")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    if wants_placement(args):
        place_model(model, args, console, default_split=None)
    with step(console, f"drawing {len(model.ops)} ops with Graphviz"):
        drawing = pl.draw(
            model,
            target,
            collapse=_collapse_option(args.collapse),
            max_nodes=args.max_nodes,
            batch=parse_dims(args.dim) or None,
        )
    per_device = ", ".join(f"{d}: {n} ops" for d, n in drawing.ops_per_device.items())
    kind = "collapsed to " if drawing.collapsed else ""
    console.print(f"{per_device}; {kind}{drawing.boxes} boxes, {drawing.copy_edges} copy edges")
    if drawing.note:
        console.print(f"[yellow]note:[/yellow] {drawing.note}", highlight=False)
    console.print(f"saved {drawing.path}")
    return 0


def _collapse_option(text: str) -> bool | str:
    return {"auto": "auto", "yes": True, "no": False}[text]
