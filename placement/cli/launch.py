"""``placement launch PLACED.onnx``: run a placed model as torch.distributed ranks (torchrun).

Example:
    $ placement launch placed.onnx --input input=x.npy --output out.npz
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import placement as pl
from placement.cli.common import check_output


def add_parser(sub: Any) -> None:
    """Add ``placement launch`` and its options to ``sub`` (the command's subparsers)."""
    p = sub.add_parser(
        "launch",
        help="run a placed model as torch.distributed ranks (runs torchrun)",
        description=(
            "Run torchrun with one process per rank of PLACED.onnx (by default one per logical device, "
            "in pipeline order) on 'python -m placement.launch'. Rank 0 reads the inputs, the last rank "
            "writes the outputs. On several hosts, run the same command on each with --nnodes and "
            "--rdzv-endpoint."
        ),
        epilog="Example: placement launch placed.onnx --input input=x.npy --output out.npz",
    )
    p.add_argument("model", metavar="PLACED.onnx", help="a placed model (see 'place')")
    p.add_argument(
        "--input", action="append", default=[], metavar="NAME=FILE.npy", help="a graph input (repeat)"
    )
    p.add_argument("--output", metavar="OUT.npz", help="where the last rank writes the outputs")
    p.add_argument(
        "--ranks", default=None, help="devices per rank, e.g. cuda:0,cuda:1 or cuda:0+cuda:1,cuda:2"
    )
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks on this host (default: all ranks)")
    p.add_argument("--nnodes", default=None, help="hosts (torchrun's --nnodes); needs --rdzv-endpoint")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (same on every host)")
    p.add_argument("--rdzv-id", default="placement", help="job id shared by the hosts (default placement)")
    p.add_argument(
        "--runtime",
        default=None,
        choices=["torch", "ort"],
        help="torch (default): the lowered module on torch.distributed.pipelining; "
        "ort: each rank runs its ONNX Runtime stage sessions (inference, no model code)",
    )
    p.add_argument(
        "--schedule", default=None, choices=["gpipe", "1f1b"], help="pipeline schedule (torch runtime)"
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="micro-batches (default: rows / graph batch, or 1 if dynamic)",
    )
    p.add_argument(
        "--backend", default=None, help="gloo or nccl (default: nccl with a GPU per rank, else gloo)"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds a rank waits for a peer (default 300)"
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank")
    p.add_argument(
        "--precision", default=None, choices=["fp32", "tf32"], help="fp32: TF32 off on GPUs (default); tf32"
    )
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command, do not run it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement launch`` with the parsed ``args``, printing to ``console``; the exit status."""
    import shlex

    import placement as pl
    from placement.distributed.launcher import run_torchrun, torchrun_command
    from placement.distributed.ranks import rank_groups

    model = pl.load(args.model)
    nproc = args.nproc_per_node or len(rank_groups(model, ranks=args.ranks))
    single = not args.nnodes or args.nnodes == "1"
    script: list[str] = []
    for spec in args.input:
        script += ["--input", spec]
    flags = ("output", "ranks", "runtime", "schedule", "chunks", "backend", "timeout", "threads", "precision")
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            script += [f"--{flag}", str(value)]
    command = torchrun_command(
        str(args.model),
        nproc=nproc,
        script_args=script,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
    )
    console.print(" ".join(shlex.quote(part) for part in command), highlight=False, soft_wrap=True)
    if args.dry_run:
        return 0
    _check_launch_arguments(args, model, single=single)
    result = run_torchrun(command, single_node=single)
    if result.returncode == 0:
        if args.verbose and result.details:
            sys.stderr.write(result.details)
        return 0
    if args.verbose:
        sys.stderr.write(result.details)
    from placement.distributed.errors import RankFailedError

    raise RankFailedError(result.message or f"torchrun failed (exit status {result.returncode})")


def _check_launch_arguments(args: argparse.Namespace, model: Any, *, single: bool) -> None:
    """Everything the ranks would refuse, refused before any rank starts."""
    from placement.launch import read_inputs
    from placement.runtime.ort.sessions import check_threads

    inputs = None
    if single or args.input:  # on several nodes only the one running rank 0 needs the inputs
        inputs = read_inputs(args.input, model.inputs)
    if args.output:
        check_output(args.output, [".npz"], "the output file")
    check_threads(args.threads, what="--threads")
    for flag in ("chunks", "timeout"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise pl.InputError(f"--{flag} must be positive, got {value}")
    if inputs is not None and args.chunks and args.runtime != "ort":
        _check_equal_micro_batches(inputs, args.chunks)


def _check_equal_micro_batches(inputs: Any, chunks: int) -> None:
    """The torch runtime's micro-batches are equal: every input's rows split into ``chunks``."""
    named = inputs.items() if isinstance(inputs, dict) else enumerate(inputs)
    for name, array in named:
        if getattr(array, "ndim", 0) and array.shape[0] % chunks:
            raise pl.InputError(
                f"--input {name!r} has {array.shape[0]} rows, which do not split into --chunks {chunks} "
                "equal micro-batches (the torch runtime needs equal ones; --runtime ort does not)"
            )
