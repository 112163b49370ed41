"""``placement run PLACED.onnx``: run a placed model, print latency and where stages ran.

Example:
    $ placement run resnet_2gpu.onnx --random-inputs --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import placement as pl
from placement.cli.common import check_output, npz_bytes, step, write_bytes
from placement.cli.inputs import DEFAULT_DIM, parse_dims, read_inputs


def add_parser(sub: Any) -> None:
    """Add ``placement run`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "run",
        help="run a placed .onnx file, print latency and where each stage ran",
        description=(
            "Run PLACED.onnx through one ONNX Runtime session per stage on inputs read from .npy files "
            "or made at random (NAME=random, --random-inputs; 'placement inspect' shows the shapes); "
            "print the latency (median and min over --repeat timed runs after one warm-up), the "
            "throughput, and the physical device of every stage; save the outputs as .npz."
        ),
        epilog=(
            "Examples: placement run placed.onnx --input x=x.npy --output out.npz --repeat 20   |   "
            "placement run placed.onnx --random-inputs --dim batch=8 --chunks 4"
        ),
    )
    p.add_argument("model", metavar="PLACED.onnx", help="a placed model saved by 'placement place'")
    p.add_argument(
        "--input",
        action="append",
        metavar="NAME=FILE.npy",
        help="an input array (repeat for each input; FILE.npy alone for a one-input model); "
        "NAME=random makes random data of the input's dtype and shape (see 'placement inspect')",
    )
    p.add_argument(
        "--random-inputs",
        action="store_true",
        help="random data for every input not given with --input (floats: standard normal; "
        "integers: valid indices of the table they index, else 0-9; seed 0)",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="NAME=N",
        help=f"size of a symbolic dimension of the random inputs, e.g. batch=8 (repeat; default "
        f"{DEFAULT_DIM}, or {DEFAULT_DIM} x K with --chunks K)",
    )
    p.add_argument("-o", "--output", metavar="OUT.npz", help="write the outputs (by name) to this .npz")
    p.add_argument(
        "--device-map",
        default="auto",
        help="logical -> physical devices: auto (GPUs if present, else emulated), cpu, cuda:0, "
        "or 0=cuda:0,1=cpu (default auto)",
    )
    p.add_argument("--chunks", type=int, help="split the batch into K micro-batches (pipelined Runner)")
    p.add_argument("--repeat", type=int, default=10, help="timed runs after the warm-up (default 10)")
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: ORT's choice)")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "tf32"],
        help="fp32: TF32 off on GPUs (default); tf32: TF32 tensor cores allowed",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement run`` with the parsed ``args``, printing to ``console``; the exit status."""
    import numpy as np

    target = check_output(args.output, [".npz"], "the output file") if args.output else None
    if args.repeat < 1:
        raise pl.InputError(f"--repeat must be at least 1, got {args.repeat}")
    options: dict[str, Any] = {"device_map": _parse_device_map(args.device_map), "precision": args.precision}
    if args.threads is not None:
        options["threads"] = args.threads
    if args.chunks is not None:
        if args.chunks < 1:
            raise pl.InputError(f"--chunks must be at least 1, got {args.chunks}")
        options["chunks"] = args.chunks
    model = pl.load(args.model)
    inputs = read_inputs(
        args.input,
        model,
        random_rest=args.random_inputs,
        dims=parse_dims(args.dim),
        default_dim=DEFAULT_DIM * (args.chunks or 1),
    )
    with step(console, "building ONNX Runtime sessions"):
        runner = pl.Runner(model, **options)
    with step(console, "first run (warm-up)"):
        outputs = runner.run(inputs)
    times = _timed_runs(runner, inputs, args.repeat, console)
    _print_stages(runner, console)
    console.print(f"precision: {runner.tolerance}", highlight=False)
    median = statistics.median(times)
    batch = next((int(a.shape[0]) for a in inputs.values() if a.ndim > 0), 1)
    console.print(
        f"latency: median {median * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms over {len(times)} run(s); "
        f"throughput {batch / median:.1f} samples/s (batch {batch})"
    )
    if target is not None:
        buffer = npz_bytes(dict(zip(runner.output_names, outputs)))
        write_bytes(target, buffer)
        console.print(f"saved {len(outputs)} output(s) to {target}: {', '.join(runner.output_names)}")
    else:
        for name, array in zip(runner.output_names, outputs):
            console.print(f"{name}: {array.dtype}{list(array.shape)} mean {float(np.mean(array)):.6g}")
    return 0


def _timed_runs(runner: Any, inputs: dict[str, Any], repeat: int, console: Any) -> list[float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    times: list[float] = []
    with Progress(
        TextColumn("timed runs"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("runs", total=repeat)
        for _ in range(repeat):
            start = time.perf_counter()
            runner.run(inputs)
            times.append(time.perf_counter() - start)
            progress.advance(task)
    return times


def _print_stages(runner: Any, console: Any) -> None:
    from rich.table import Table

    device_map = runner.device_map
    table = Table(title="where each stage ran")
    for column in ("stage", "logical device", "ran on", "ops", "inputs", "outputs"):
        table.add_column(column, justify="right" if column in ("stage", "ops") else "left")
    for stage in runner.stages:
        physical = device_map.get(stage.device)
        where = str(physical) + (" (emulated)" if physical is not None and physical.emulated else "")
        table.add_row(
            str(stage.index),
            "+".join(map(str, stage.folded)) if stage.folded else str(stage.device),
            where,
            str(len(stage.ops)),
            _clip(", ".join(stage.inputs)),
            _clip(", ".join(stage.outputs)),
        )
    console.print(table)


def _clip(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_device_map(text: str) -> Any:
    """``auto`` | ``cpu`` | ``cuda:0`` | ``0=cuda:0,1=cpu`` -> what ``pl.Runner`` accepts."""
    if "=" not in text:
        return text
    mapping: dict[str, str] = {}
    for item in text.split(","):
        logical, sep, physical = item.partition("=")
        if not sep or not logical.strip() or not physical.strip():
            raise pl.DeviceError(f"bad --device-map item {item!r}: use LOGICAL=PHYSICAL, e.g. 0=cuda:0,1=cpu")
        mapping[logical.strip()] = physical.strip()
    return mapping
