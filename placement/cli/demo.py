"""``placement demo``: place a built-in model, run it on both runtimes, check against torch.

Example:
    $ placement demo --model gpt --devices 2
"""

from __future__ import annotations

import argparse
from typing import Any

from placement.cli.common import SIZE_HELP


def add_parser(sub: Any) -> None:
    """Add ``placement demo`` and its options to ``sub`` (the command's subparsers)."""
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
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.add_argument("--devices", type=int, default=2, help="number of logical GPUs (default 2)")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "tf32"],
        help="fp32: TF32 off on GPUs, strict check (default); tf32: TF32 on, checked with its tolerance",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement demo`` with the parsed ``args``, printing to ``console``; the exit status."""
    from placement.demo import run_demo

    result = run_demo(
        args.model, size=args.size, devices=args.devices, console=console, precision=args.precision
    )
    return 0 if result.ok else 1
