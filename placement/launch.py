"""Run a placed ONNX model as ``torch.distributed`` ranks: the entry point for ``torchrun``.

Usage (one process per rank; torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous)::

    torchrun --nproc-per-node 2 -m placement.launch placed.onnx \\
        --input input=x.npy --output out.npz

Every rank loads the placed model and builds its pipeline stage
(:class:`placement.distributed.DistributedPipeline`, the lowered torch module; or
with ``--runtime ort`` :class:`placement.distributed.DistributedRunner`, its ONNX
Runtime stage sessions: serving without model code); a model split by
:func:`placement.split_tensor_parallel` runs one device per rank instead
(:class:`placement.distributed.DistributedTensorParallel`, or on ONNX Runtime
:class:`placement.distributed.DistributedTensorParallelRunner`: each collective one
``torch.distributed`` all-reduce or all-gather), and a split inside pipeline stages
(``devices=[[0, 1], [2, 3]]``) as a grid of ranks
(:class:`placement.distributed.DistributedTensorPipeline`); rank 0 reads the inputs
(``--input NAME=FILE.npy`` per graph input, or ``--input FILE.npy`` for a
one-input model) and the rank holding the graph outputs (the last one of a pipeline, rank 0
of a tensor-parallel split, the first of the last group of a grid) writes them to ``--output``
(an ``.npz`` keyed by graph-output name, written to a temporary file first so a
failed run never clobbers an existing one). Inputs with ``k`` times the graph's
batch size run as ``k`` micro-batches. ``placement launch`` runs torchrun for you.

Exit status: 0 on success; 2 for bad input or a placement the world does not fit
(the message names the rank and the problem); 3 when another rank failed (the
message names it).

Example:
    >>> from placement.launch import build_parser
    >>> args = build_parser().parse_args(["placed.onnx", "--input", "x=x.npy", "--output", "y.npz"])
    >>> args.schedule, args.input, args.runtime
    ('gpipe', ['x=x.npy'], 'torch')
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "read_inputs", "write_outputs"]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m placement.launch``."""
    parser = argparse.ArgumentParser(
        prog="python -m placement.launch",
        description="Run a placed ONNX model as torch.distributed ranks (start it with torchrun).",
        epilog="Example: torchrun --nproc-per-node 2 -m placement.launch placed.onnx "
        "--input input=x.npy --output out.npz",
    )
    parser.add_argument("model", metavar="PLACED.onnx", help="a placed model saved by placement")
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="a graph input (repeat per input; FILE.npy alone for a one-input model); read on rank 0",
    )
    parser.add_argument("--output", metavar="OUT.npz", help="where the last rank writes the graph outputs")
    parser.add_argument(
        "--ranks", default=None, help="logical devices per rank, e.g. cuda:0,cuda:1 or cuda:0+cuda:1,cuda:2"
    )
    parser.add_argument(
        "--runtime",
        default="torch",
        choices=["torch", "ort"],
        help="torch: the lowered module under torch.distributed.pipelining (default); "
        "ort: each rank runs its ONNX Runtime stage sessions (inference)",
    )
    parser.add_argument(
        "--schedule", default="gpipe", choices=["gpipe", "1f1b"], help="pipeline schedule (torch runtime)"
    )
    parser.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="micro-batches (default: rows / graph batch; 1 when the graph's batch is dynamic)",
    )
    parser.add_argument(
        "--backend", default=None, help="gloo or nccl (default: nccl with a GPU per rank, else gloo)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for a peer before failing (default 300)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads per rank (torch.set_num_threads; per stage session with --runtime ort)",
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "tf32"],
        help="fp32 on GPUs: TF32 off (default, outputs match the CPU's); tf32: TF32 tensor cores allowed",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    return parser


def read_inputs(specs: Sequence[str], input_names: Sequence[str]) -> dict[str, Any] | list[Any]:
    """``["x=x.npy", ...]`` -> ``{"x": array, ...}`` (or ``[array]`` for ``["x.npy"]``).

    Raises:
        InputError: a missing or unreadable file, or a name that is not a graph input.

    Example:
        >>> read_inputs([], ["x"])
        Traceback (most recent call last):
        ...
        placement.errors.InputError: no --input given; the model's inputs are: 'x'
    """
    import numpy as np

    from placement.errors import InputError

    if not specs:
        listed = ", ".join(map(repr, input_names))
        raise InputError(f"no --input given; the model's inputs are: {listed}")
    named: dict[str, Any] = {}
    positional: list[Any] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise InputError(f"cannot read --input {spec!r}: {err}") from err
        if name:
            if name not in input_names:
                listed = ", ".join(map(repr, input_names))
                raise InputError(f"--input {spec!r}: {name!r} is not a graph input; the inputs are: {listed}")
            named[name] = array
        else:
            positional.append(array)
    if named and positional:
        raise InputError("give every --input as NAME=FILE.npy, or all of them as FILE.npy in input order")
    return named or positional


def write_outputs(path: str | Path, names: Sequence[str], arrays: Sequence[Any]) -> None:
    """Write ``arrays`` to ``path`` as ``.npz`` keyed by ``names``, atomically.

    Example:
        >>> import numpy as np, tempfile, os
        >>> out = os.path.join(tempfile.mkdtemp(), "out.npz")
        >>> write_outputs(out, ["y"], [np.ones(2)])
        >>> np.load(out)["y"].tolist()
        [1.0, 1.0]
    """
    import numpy as np

    from placement.errors import ModelSaveError
    from placement.graph.atomic import write_atomic

    buffer = io.BytesIO()
    np.savez(buffer, **dict(zip(names, arrays)))
    try:
        write_atomic(path, buffer.getvalue(), what="outputs")
    except OSError as err:
        raise ModelSaveError(f"cannot write outputs to {str(path)!r}: {err}") from err


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m placement.launch`` (run under torchrun)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from placement.distributed import RankFailedError
    from placement.distributed.backend import choose_backend
    from placement.errors import PlacementError

    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    _tie_to_agent()
    try:
        from placement.runtime.ort.sessions import check_threads

        threads = check_threads(args.threads, what="--threads")
    except PlacementError as err:
        return _fail(rank, f"error: {err}", code=2, own=True)
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    if "WORLD_SIZE" not in os.environ:
        print(
            "placement.launch: not started by torchrun (no WORLD_SIZE); running as a single rank",
            file=sys.stderr,
        )
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from placement.distributed import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
    try:
        choice = choose_backend(args.backend)  # NCCL only with a GPU per rank, else gloo via host memory
    except PlacementError as err:
        print(f"placement.launch: rank {rank}: error: {err}", file=sys.stderr)
        return 2
    if choice.note and rank == 0:
        print(choice.note, file=sys.stderr)
    backend, device = choice.backend, choice.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    pipe: Any = None
    try:
        pipe = _rank_runner(args, device, threads)
        inputs = read_inputs(args.input, pipe.input_names) if pipe.is_first else None
        outputs = pipe.run(inputs)
        if pipe.is_last and outputs is not None:
            if args.output:
                write_outputs(args.output, pipe.output_names, outputs)
                print(f"placement.launch: rank {rank} wrote {', '.join(pipe.output_names)} to {args.output}")
            else:
                for name, array in zip(pipe.output_names, outputs):
                    print(f"placement.launch: {name}: shape {tuple(array.shape)}, dtype {array.dtype}")
        pipe.barrier()  # every rank learns whether the others got through
        return 0
    except RankFailedError as err:
        return _fail(rank, str(err), code=3, own=False)
    except PlacementError as err:
        if pipe is not None:
            pipe.report_failure(err)
        return _fail(rank, f"error: {err}", code=2, own=True)
    except BaseException as err:
        if pipe is not None:
            pipe.report_failure(err)
        from placement.distributed.launcher import record_rank_error

        record_rank_error(rank, f"{type(err).__name__}: {err}", own=True)
        raise
    finally:
        if pipe is not None:
            pipe.close()
        dist.destroy_process_group()


def _rank_runner(args: argparse.Namespace, device: Any, threads: int | None) -> Any:
    """This rank's runner: tensor-parallel ranks for a model with collectives, else a pipeline
    stage (the lowered module, or ONNX Runtime sessions with ``--runtime ort``)."""
    from placement.distributed import (
        DistributedPipeline,
        DistributedRunner,
        DistributedTensorParallel,
        DistributedTensorParallelRunner,
        DistributedTensorPipeline,
    )
    from placement.distributed.grid import is_grid
    from placement.distributed.spmd import is_tensor_parallel
    from placement.errors import InputError
    from placement.graph.loading import load

    model = load(args.model)
    if is_grid(model):  # a split inside pipeline stages: a grid of ranks, one per device
        if args.ranks or args.runtime == "ort":
            raise InputError(
                f"{args.model} is split tensor-parallel inside its pipeline stages: it runs one rank "
                "per device on the torch runtime (no --ranks, no --runtime ort)"
            )
        return DistributedTensorPipeline(model, schedule=args.schedule, chunks=args.chunks, device=device)
    if is_tensor_parallel(model):
        if args.chunks not in (None, 1) or args.ranks:
            raise InputError(
                f"{args.model} is split tensor-parallel: one rank per device runs the whole batch "
                "(no --chunks or --ranks)"
            )
        if args.runtime == "ort":
            return DistributedTensorParallelRunner(
                model, device=device, threads=threads, precision=args.precision
            )
        return DistributedTensorParallel(model, device=device)
    if args.runtime == "ort":
        return DistributedRunner(
            model,
            ranks=args.ranks,
            chunks=args.chunks,
            device=device,
            threads=threads,
            precision=args.precision,
        )
    return DistributedPipeline(
        model, ranks=args.ranks, schedule=args.schedule, chunks=args.chunks, device=device
    )


def _fail(rank: int, message: str, *, code: int, own: bool) -> int:
    """Print a rank's one-line failure and leave it where ``placement launch`` reads it."""
    from placement.distributed.launcher import record_rank_error

    print(f"placement.launch: rank {rank}: {message}", file=sys.stderr)
    record_rank_error(rank, message.removeprefix("error: "), own=own)
    return code


def _tie_to_agent() -> None:
    """Under ``placement launch``, die with torchrun's agent (nothing runs on after the launcher)."""
    from placement.distributed.launcher import TIE_ENV, die_with_parent

    if os.environ.get(TIE_ENV) == "1":
        die_with_parent()


if __name__ == "__main__":
    sys.exit(main())
