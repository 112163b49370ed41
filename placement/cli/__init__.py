"""The ``placement`` command.

Subcommands::

    placement models                         list the built-in models
    placement inspect MODEL                  inputs (dtype, shape), per-device table, scopes, parameters
    placement plan MODEL -o PLAN.json        plan a placement (devices, memory budgets) without placing
    placement place MODEL -o OUT.onnx        place a model (equal split, --auto, or --plan) and save it
    placement run PLACED.onnx --input x=x.npy --output out.npz
                                             run a placed model, print latency and where stages ran
                                             (--input x=random or --random-inputs: no files needed)
    placement generate MODEL --input-ids 5,17,33 --max-new-tokens 32 --devices 2
                                             generate with a causal LM (KV cache) split across devices
    placement draw MODEL -o placed.svg       picture of the graph coloured by device (svg/png/pdf/dot)
    placement report MODEL -o report.html    one self-contained HTML page: tables, charts, the graph
    placement demo                           the main job: place the default model on 2 devices,
                                             run it through ONNX Runtime and torch, check outputs
    placement launch PLACED.onnx ...         run a placed model as torch.distributed ranks (torchrun)

Each subcommand is a module of this package with ``add_parser(subparsers)`` and
``run(args, console)``; :func:`build_parser` builds the parser from them (shared helpers:
:mod:`placement.cli.common`, :mod:`placement.cli.placing`, :mod:`placement.cli.inputs`).
Every subcommand has ``--help``. Errors print one line naming the problem, write
nothing, and exit with status 2. Steps that can take seconds (export, profiling,
planning, session builds) show a spinner on a terminal and stay quiet otherwise.

Example:
    $ placement inspect gpt --size tiny
    $ placement place resnet --auto --max-memory 0=2GiB,1=6GiB -o resnet_2gpu.onnx
    $ placement run resnet_2gpu.onnx --input x=x.npy --output out.npz --repeat 20
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from placement.cli import demo, draw, generate, inspect, launch, models, place, plan, report, run
from placement.cli.common import load_model_spec
from placement.errors import PlacementError
from placement.runtime.device_map import command_line_spelling

__all__ = ["main", "build_parser", "load_model_spec"]


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (like every other error of the command)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


#: Each sub-command's module, in the order ``placement --help`` lists them.
_COMMANDS = (models, inspect, plan, place, run, generate, draw, report, demo, launch)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``placement`` command."""
    parser = _Parser(
        prog="placement",
        description="Split neural networks across devices at the operator-graph level.",
        epilog="Run 'placement COMMAND --help' for the options of each command.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``placement`` console script."""
    from rich.console import Console
    from rich.logging import RichHandler

    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    # log records (warnings included) go to stderr: stdout holds only what the command prints;
    # in pipes and CI logs one plain line per record
    errors = Console(stderr=True)
    handler: logging.Handler
    if errors.is_terminal:
        handler = RichHandler(console=errors, show_path=False)
        logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
    else:
        logging.basicConfig(level=level, format="%(levelname)s: %(message)s", stream=sys.stderr)
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: do not squeeze tables into 80 columns
        console = Console(width=max(console.width, 140))
    if getattr(args, "model", "") is None:
        from placement.models import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    try:
        with command_line_spelling():
            return int(args.func(args, console))
    except PlacementError as err:
        message = " ".join(str(err).split())  # one line, whatever the message holds
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {message}", highlight=False)
        return 2
    except OSError as err:  # the terminal or a file outside the library's control
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {err}", highlight=False)
        return 2
    except Exception as err:  # a bug: one line, the traceback with -v
        if args.verbose:
            raise
        message = f"internal error ({type(err).__name__}: {err}); run with -v for the traceback"
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {message}", highlight=False)
        return 1
