"""``placement plan MODEL -o PLAN.json``: plan a placement without placing.

Example:
    $ placement plan gpt --devices 2 -o plan.json
"""

from __future__ import annotations

import argparse
from typing import Any

import placement as pl
from placement.cli.common import MODEL_HELP, SIZE_HELP, check_output, load_model_spec, write_text
from placement.cli.placing import add_planner_options, auto_plan


def add_parser(sub: Any) -> None:
    """Add ``placement plan`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "plan",
        help="plan a placement and save it as JSON (the model is not written)",
        description=(
            "Run the automatic planner on MODEL for N devices and/or memory budgets, print the plan "
            "(per-device cost, memory, bytes copied, bottleneck against the lower bound) and save it. "
            "Apply it later with 'placement place MODEL --plan PLAN.json'."
        ),
        epilog="Example: placement plan gpt --devices 2 -o plan.json",
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="path of the plan .json file to write")
    add_planner_options(p, devices_default=None)
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement plan`` with the parsed ``args``, printing to ``console``; the exit status."""
    target = check_output(args.output, [".json"], "the plan file")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    if any(op.is_copy for op in model.iter_ops()):
        raise pl.PlanError(f"{args.model} already has copies (it is placed): plan the unplaced model")
    plan = auto_plan(model, args, console)
    console.print(plan.to_table())
    write_text(target, plan.to_json())
    console.print(f"saved {target}")
    return 0
