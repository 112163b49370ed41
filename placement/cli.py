"""The ``placement`` command.

Subcommands::

    placement models                         list the built-in models
    placement inspect MODEL                  per-device table of a model (.onnx file or built-in name)
    placement place MODEL -o OUT.onnx        place a model on N devices and save it
    placement demo                           the main job: place the default model on 2 devices,
                                             run it through ONNX Runtime and torch, check outputs

Every subcommand has ``--help``. Errors print one line naming the problem and exit with status 2.

Example:
    $ placement inspect gpt --size tiny
    $ placement place resnet --devices 2 -o resnet_2gpu.onnx
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import placement as pl
from placement.errors import PlacementError

__all__ = ["main", "build_parser", "load_model_spec"]

log = logging.getLogger(__name__)


def load_model_spec(spec: str, *, size: str = "tiny", seed: int = 0) -> tuple[Any, Any, tuple]:
    """Load MODEL as the CLI understands it: an ONNX file or a built-in model name.

    Returns ``(model, torch_module_or_None, example_args_or_None)``.

    Raises:
        PlacementError: neither a readable file nor a known model name.
    """
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        return pl.load(path), None, ()
    from placement import models

    if spec not in models.MODELS:
        known = ", ".join(sorted(models.MODELS))
        raise pl.PlanError(f"{spec!r} is neither an ONNX file nor a built-in model ({known})")
    if size not in models.SIZES:
        raise pl.PlanError(f"unknown size {size!r}; choose from {', '.join(models.SIZES)}")
    net, args = models.build(spec, size, seed=seed)
    return pl.from_torch(net, args), net, args


def _cmd_models(args: argparse.Namespace, console: Any) -> int:
    from rich.table import Table

    from placement import models

    table = Table(title="built-in models")
    table.add_column("name")
    table.add_column("description")
    for name, module in sorted(models.MODELS.items()):
        doc = (module.__doc__ or "").strip().splitlines()
        table.add_row(name + (" (default)" if name == models.DEFAULT_MODEL else ""), doc[0] if doc else "")
    console.print(table)
    return 0


def _cmd_inspect(args: argparse.Namespace, console: Any) -> int:
    model, _, _ = load_model_spec(args.model, size=args.size)
    console.print(f"[bold]{args.model}[/bold]: {model!r}")
    summary = pl.summary(model)
    if args.json:
        console.print_json(data=summary.to_dict())
    else:
        console.print(summary.to_table())
    return 0


def _cmd_place(args: argparse.Namespace, console: Any) -> int:
    model, _, _ = load_model_spec(args.model, size=args.size)
    if args.devices < 1:
        raise pl.PlanError(f"--devices must be at least 1, got {args.devices}")
    if args.auto:
        plan = pl.auto_place(model, devices=args.devices, cost=args.cost)
        console.print(plan.to_table())
    else:
        pl.place_evenly(model, args.devices, copies=False)
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    model.save(args.output)
    console.print(pl.summary(model).to_table())
    console.print(f"saved {args.output}")
    return 0


def _cmd_demo(args: argparse.Namespace, console: Any) -> int:
    from placement.demo import run_demo

    result = run_demo(args.model, size=args.size, devices=args.devices, console=console)
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``placement`` command."""
    parser = argparse.ArgumentParser(
        prog="placement",
        description="Split neural networks across devices at the operator-graph level.",
        epilog="Run 'placement COMMAND --help' for the options of each command.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "models",
        help="list the built-in models",
        description="List the built-in models (usable as MODEL in 'inspect' and 'place', and in 'demo').",
        epilog="Example: placement models",
    )
    p.set_defaults(func=_cmd_models)

    size_help = "size of a built-in model: tiny (tests) or bench (benchmarks); default tiny"
    p = sub.add_parser(
        "inspect",
        help="per-device table of a model",
        description="Print a per-device table (ops, parameter bytes, activations, copies) of MODEL.",
        epilog="Example: placement inspect gpt   |   placement inspect placed.onnx --json",
    )
    p.add_argument("model", metavar="MODEL", help="an .onnx file or a built-in model name (see 'models')")
    p.add_argument("--size", default="tiny", help=size_help)
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "place",
        help="place a model on N devices and save it as ONNX",
        description=(
            "Place MODEL on N logical GPUs and save the placed ONNX (with explicit copies). By default "
            "the activations are split into N equal consecutive runs (Caffe2-style shifts); --auto uses "
            "the automatic planner."
        ),
        epilog="Example: placement place resnet --devices 2 -o resnet_2gpu.onnx",
    )
    p.add_argument("model", metavar="MODEL", help="an .onnx file or a built-in model name")
    p.add_argument("-o", "--output", required=True, help="path of the placed .onnx file to write")
    p.add_argument("--devices", type=int, default=2, help="number of logical GPUs (default 2)")
    p.add_argument("--auto", action="store_true", help="use the automatic planner (pl.auto_place)")
    p.add_argument(
        "--cost", default="size", choices=["time", "size", "flops"], help="planner cost (with --auto)"
    )
    p.add_argument("--size", default="tiny", help=size_help)
    p.set_defaults(func=_cmd_place)

    p = sub.add_parser(
        "demo",
        help="the main job: place, run on both runtimes, check against torch",
        description=(
            "Build a built-in model, shift the second half of its activations to device 1, inject "
            "copies, run it through per-device ONNX Runtime sessions and the lowered torch module, "
            "check both against the original module and print the per-device table and timings."
        ),
    )
    p.add_argument("--model", default=None, help="built-in model name (default: the zoo's default)")
    p.add_argument("--size", default="tiny", help=size_help)
    p.add_argument("--devices", type=int, default=2, help="number of logical GPUs (default 2)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``placement`` console script."""
    from rich.console import Console
    from rich.logging import RichHandler

    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(show_path=False)])
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: do not squeeze tables into 80 columns
        console = Console(width=max(console.width, 140))
    if getattr(args, "model", "") is None:
        from placement import models

        args.model = models.DEFAULT_MODEL
    try:
        return int(args.func(args, console))
    except PlacementError as err:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {err}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
