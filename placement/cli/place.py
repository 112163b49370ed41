"""``placement place MODEL -o OUT.onnx``: place a model and save it.

Example:
    $ placement place resnet --auto --max-memory 0=2GiB,1=6GiB -o resnet_2gpu.onnx
"""

from __future__ import annotations

import argparse
from typing import Any

import placement as pl
from placement.cli.common import MODEL_HELP, SIZE_HELP, check_output, load_model_spec, step
from placement.cli.placing import add_place_options, place_model


def add_parser(sub: Any) -> None:
    """Add ``placement place`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "place",
        help="place a model on N devices and save it as ONNX",
        description=(
            "Place MODEL and save the placed ONNX (with explicit copies). By default the activations "
            "are split into N equal consecutive runs (Caffe2-style shifts); --auto (or --max-memory) "
            "uses the automatic planner and prints its plan; --plan applies a saved plan."
        ),
        epilog=(
            "Examples: placement place resnet --devices 2 -o r.onnx   |   "
            "placement place gpt --auto --max-memory 0=2GiB,1=6GiB -o g.onnx   |   "
            "placement place gpt --plan plan.json -o g.onnx"
        ),
    )
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="path of the placed .onnx file to write")
    add_place_options(p)
    p.add_argument(
        "--dynamic-batch",
        action="store_true",
        help="export a built-in model with a symbolic batch dimension (axis 0 of every input), so "
        "'placement run --chunks K' can pipeline it and any batch size runs",
    )
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement place`` with the parsed ``args``, printing to ``console``; the exit status."""
    target = check_output(args.output, [".onnx"], "the placed model")
    model, _, _ = load_model_spec(
        args.model, size=args.size, console=console, dynamic_batch=args.dynamic_batch
    )
    plan = place_model(model, args, console, default_split=2)
    if plan is not None:
        console.print(plan.to_table())
    with step(console, f"saving {target}"):
        model.save(target)
    console.print(pl.summary(model).to_table())
    console.print(f"saved {target}")
    return 0
