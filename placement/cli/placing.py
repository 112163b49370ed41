"""Placing a model as the options say: the planner options, the planner, an equal split or a saved plan.

Example:
    >>> from placement.cli.placing import parse_max_memory
    >>> parse_max_memory("0=2GiB,cpu=48GiB")
    {'0': '2GiB', 'cpu': '48GiB'}
"""

from __future__ import annotations

import argparse
from typing import Any

import placement as pl
from placement.cli.common import step
from placement.cli.inputs import planner_inputs


def parse_max_memory(text: str | None) -> dict[str, str] | None:
    """``"0=2GiB,1=6GiB"`` -> ``{"0": "2GiB", "1": "6GiB"}`` (sizes checked by the planner)."""
    if text is None:
        return None
    budgets: dict[str, str] = {}
    for item in text.split(","):
        device, sep, size = item.partition("=")
        if not sep or not device.strip() or not size.strip():
            raise pl.PlanError(f"bad --max-memory item {item!r}: use DEVICE=SIZE, e.g. 0=2GiB,1=6GiB")
        budgets[device.strip()] = size.strip()
    return budgets


def parse_tensor_parallel(text: str) -> int | str:
    """``--tensor-parallel``: ``"auto"`` or a degree.

    Example:
        >>> parse_tensor_parallel("auto"), parse_tensor_parallel("4")
        ('auto', 4)
    """
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a degree (an integer), got {text!r}") from None


def auto_plan(model: Any, args: argparse.Namespace, console: Any) -> Any:
    """Run the planner on ``model`` (in place) from --devices / --max-memory / --cost / --objective
    / --tensor-parallel."""
    tensor_parallel = getattr(args, "tensor_parallel", None)
    if args.cost is None:  # a split is weighed in times: FLOPs at the device's speed, unless --cost time
        args.cost = "size" if tensor_parallel is None else "flops"
    budgets = parse_max_memory(getattr(args, "max_memory", None))
    devices = args.devices if args.devices is not None or budgets is None else None
    if devices is None and budgets is None:
        devices = 2
    if isinstance(devices, int) and devices < 1:
        raise pl.PlanError(f"--devices must be at least 1, got {devices}")
    runtime = getattr(args, "runtime", "ort")
    sample_inputs, batch = planner_inputs(args, model)
    if getattr(args, "calibrate", False):
        if args.cost != "time" or args.objective != "throughput":
            raise pl.PlanError(
                "--calibrate times the plan's stages: use it with --cost time and --objective throughput"
            )
        what = "ONNX Runtime stage sessions" if runtime == "ort" else "lowered torch stages"
        with step(console, f"profiling, planning and timing {what} (calibration)"):
            return pl.calibrate(
                model, devices, budgets, runtime=runtime, sample_inputs=sample_inputs, batch=batch
            ).plan
    what = "profiling and planning" if args.cost == "time" else "planning"
    with step(console, f"{what} ({args.cost} cost, {args.objective}, for {runtime})"):
        return pl.auto_place(
            model,
            devices,
            budgets,
            cost=args.cost,
            objective=args.objective,
            runtime=runtime,
            sample_inputs=sample_inputs,
            batch=batch,
            tensor_parallel=tensor_parallel,
        )


def is_placed(model: Any) -> bool:
    return len(model.devices) > 1 or any(op.is_copy for op in model.iter_ops())


def wants_planner(args: argparse.Namespace) -> bool:
    """Whether the options ask for the automatic planner (--auto, --max-memory, --calibrate or
    --tensor-parallel)."""
    return bool(args.auto or args.max_memory or args.calibrate or getattr(args, "tensor_parallel", None))


def wants_placement(args: argparse.Namespace) -> bool:
    """Whether the options ask to place the model (a split, the planner or a saved plan)."""
    return args.devices is not None or bool(args.plan) or wants_planner(args)


def place_model(model: Any, args: argparse.Namespace, console: Any, *, default_split: int | None) -> Any:
    """Place ``model`` as the options say; returns the plan (or None). Copies are injected."""
    plan = None
    if getattr(args, "plan", None):
        if wants_planner(args):
            raise pl.PlanError("--plan applies a saved plan: leave out --auto, --max-memory and --calibrate")
        plan = pl.Plan.load(args.plan)
        plan.apply(model)
    elif wants_planner(args):
        plan = auto_plan(model, args, console)
    elif args.devices is not None or default_split is not None:
        count = args.devices if args.devices is not None else default_split
        if count < 1:
            raise pl.PlanError(f"--devices must be at least 1, got {count}")
        pl.place_evenly(model, count, copies=False)
    with step(console, "injecting copies"):
        pl.inject_cross_device_copies(model)
        pl.verify(model)
    return plan


def add_planner_options(p: argparse.ArgumentParser, *, devices_default: int | None) -> None:
    p.add_argument(
        "--devices",
        type=int,
        default=devices_default,
        help="number of logical GPUs" + (f" (default {devices_default})" if devices_default else ""),
    )
    p.add_argument(
        "--max-memory",
        metavar="DEV=SIZE,...",
        help=(
            "memory budget per device for the planner, e.g. 0=2GiB,1=6GiB (implies --auto); one GPU and "
            "the host, 0=2GiB,cpu=48GiB, plans layers resident, streamed from the host or on the host"
        ),
    )
    p.add_argument(
        "--cost",
        default=None,
        choices=["time", "size", "flops"],
        help="planner cost: measured time, parameter+output bytes, or FLOPs (default size; flops with "
        "--tensor-parallel, at the device's speed)",
    )
    p.add_argument(
        "--objective",
        default="throughput",
        choices=["throughput", "latency"],
        help="planner objective (default throughput: smallest bottleneck)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=parse_tensor_parallel,
        metavar="auto|T",
        help="split stages through their layers over T devices (pl.split_tensor_parallel; implies the "
        "planner): --devices / T pipeline stages, each over its own group of T; auto weighs every divisor "
        "of --devices from the cost model and keeps the best for --objective",
    )
    p.add_argument(
        "--runtime",
        default="ort",
        choices=["ort", "torch"],
        help="with --cost time, the executor the plan is balanced for: ONNX Runtime's optimised "
        "sessions (ort, the default; no cut inside a fused group) or op by op (torch, for to_torch)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="with --cost time: re-plan on the measured times of the plan's stages (ONNX Runtime "
        "stage sessions, or with --runtime torch the lowered torch stages) and keep the best "
        "measured plan (pl.calibrate; a few seconds more)",
    )
    add_input_options(p)


def add_input_options(p: argparse.ArgumentParser) -> None:
    """``--input`` and ``--dim``: the sample inputs and the batch sizes are counted at."""
    p.add_argument(
        "--input",
        action="append",
        metavar="NAME=FILE.npy",
        help="a sample input for profiling and for the sizes activations count at (repeat per input; "
        "FILE.npz alone gives every input by name; NAME=random makes one at the --dim sizes)",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="NAME=N",
        help="size of a symbolic input dimension to plan, draw and report at, e.g. batch=8 (repeat; "
        "default: the --input sizes, else the sizes a saved placement was planned at, else 1)",
    )


def add_place_options(p: argparse.ArgumentParser) -> None:
    add_planner_options(p, devices_default=None)
    p.add_argument("--auto", action="store_true", help="place with the automatic planner (pl.auto_place)")
    p.add_argument("--plan", metavar="PLAN.json", help="apply a plan saved by 'placement plan'")
