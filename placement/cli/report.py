"""``placement report MODEL -o report.html``: one self-contained HTML page.

Example:
    $ placement report gpt --devices 2 -o report.html
"""

from __future__ import annotations

import argparse
from typing import Any

import placement as pl
from placement.cli.common import MODEL_HELP, SIZE_HELP, check_output, load_model_spec, step
from placement.cli.inputs import parse_dims
from placement.cli.placing import add_place_options, auto_plan, is_placed, wants_placement


def add_parser(sub: Any) -> None:
    """Add ``placement report`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "report",
        help="write one self-contained HTML report (tables, charts, graph picture)",
        description=(
            "Plan MODEL for --devices N (and --max-memory budgets) with the automatic planner, or take "
            "a placed .onnx as it is, and write one HTML page without external resources: the "
            "per-device table, time and memory per device against the budgets, bytes copied per cut, "
            "the planner's bottleneck against its lower bound, and the graph picture."
        ),
        epilog="Example: placement report gpt --devices 2 --max-memory 0=1MiB,1=1MiB -o report.html",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="the .html file to write")
    add_place_options(p)
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement report`` with the parsed ``args``, printing to ``console``; the exit status."""
    target = check_output(args.output, [".html", ".htm"], "the report")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    plan = None
    if wants_placement(args) or not is_placed(model):
        if any(op.is_copy for op in model.iter_ops()):
            raise pl.PlanError(f"{args.model} is already placed: report it as it is (leave out --devices)")
        if args.plan:
            plan = pl.Plan.load(args.plan)
            plan.apply(model)
        else:
            plan = auto_plan(model, args, console)
        pl.inject_cross_device_copies(model)
    with step(console, "writing the report (charts, graph picture)"):
        report = pl.write_report(model, target, plan=plan, batch=parse_dims(args.dim) or None)
    if plan is not None:
        console.print(plan.to_table())
    if report.drawing.note:
        console.print(f"[yellow]note:[/yellow] {report.drawing.note}", highlight=False)
    console.print(f"saved {target}")
    return 0
