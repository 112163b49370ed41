"""Helpers every subcommand shares: loading MODEL, the spinner, checking and writing outputs.

Example:
    >>> from placement.cli.common import check_output
    >>> check_output("plan.json", [".json"], "the plan file").name
    'plan.json'
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import placement as pl

log = logging.getLogger(__name__)


SIZE_HELP = "size of a built-in model: tiny (tests) or bench (benchmarks); default tiny"


MODEL_HELP = "an .onnx file or a built-in model name (see 'placement models')"


@contextlib.contextmanager
def step(console: Any, description: str) -> Iterator[None]:
    """A spinner with elapsed time while a slow step runs (only on a terminal)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        progress.add_task(description, total=None)
        yield
    log.info("%s: done", description)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def load_model_spec(
    spec: str, *, size: str = "tiny", seed: int = 0, console: Any = None, dynamic_batch: bool = False
) -> tuple[Any, Any, tuple]:
    """Load MODEL as the CLI understands it: an ONNX file or a built-in model name.

    With ``dynamic_batch``, a built-in model is exported with a symbolic ``batch``
    dimension (axis 0 of every input), so it can be run with any batch size and
    pipelined (``placement run --chunks K``); an ONNX file must already have one.

    Returns ``(model, torch_module_or_None, example_args_or_None)``.

    Raises:
        PlacementError: neither a readable file nor a known model name, or an ONNX
            file without a batch dimension when ``dynamic_batch`` asks for one.
    """
    spinner = (lambda text: step(console, text)) if console is not None else (lambda text: nothing())
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        with spinner(f"loading {spec}"):
            model = pl.load(path)
        if dynamic_batch:
            _check_dynamic_batch(model, spec)
        return model, None, ()
    from placement import models

    if spec not in models.MODELS:
        known = ", ".join(sorted(models.MODELS))
        raise pl.PlanError(f"{spec!r} is neither an ONNX file nor a built-in model ({known})")
    if size not in models.SIZES:
        raise pl.PlanError(f"unknown size {size!r}; choose from {', '.join(models.SIZES)}")
    net, args = models.build(spec, size, seed=seed)
    shapes = batch_dynamic_shapes(args) if dynamic_batch else None
    with spinner(f"exporting {spec} ({size}) to ONNX" + (" with a dynamic batch" if dynamic_batch else "")):
        return pl.from_torch(net, args, dynamic_shapes=shapes), net, args


def batch_dynamic_shapes(args: Sequence[Any]) -> tuple[Any, ...]:
    """``dynamic_shapes`` for :func:`placement.from_torch` making axis 0 of every input ``batch``.

    Example:
        >>> import torch
        >>> from placement.cli.common import batch_dynamic_shapes
        >>> shapes = batch_dynamic_shapes((torch.zeros(2, 8), torch.tensor(1.0)))
        >>> shapes[0][0].__name__, shapes[1]
        ('batch', None)
    """
    import torch

    batch = torch.export.Dim("batch")
    return tuple({0: batch} if getattr(a, "ndim", 0) > 0 else None for a in args)


def _check_dynamic_batch(model: Any, spec: str) -> None:
    """Refuse an ONNX file none of whose inputs has a symbolic first dimension."""
    from placement.runtime.inputs import input_specs

    specs = [s for s in input_specs(model.graph) if s.kind == "tensor"]
    if any(s.shape and not isinstance(s.shape[0], int) for s in specs):
        return
    described = ", ".join(f"{s.name}: {s.describe()}" for s in specs) or "no inputs"
    raise pl.ExportError(
        f"{spec} has a fixed batch size ({described}); --dynamic-batch re-exports built-in models "
        "only: export your module with pl.from_torch(net, args, "
        "dynamic_shapes=({0: torch.export.Dim('batch')},)) and save it"
    )


def check_output(path: str, suffixes: Sequence[str], what: str) -> Path:
    """Refuse an output path before any work: not a file, wrong suffix or missing folder."""
    from placement.errors import ModelSaveError

    target = Path(path)
    if target.is_dir():
        raise ModelSaveError(f"cannot write {path!r}: it is a folder")
    if target.exists() and not target.is_file():
        raise ModelSaveError(f"cannot write {path!r}: not a regular file")
    if suffixes and target.suffix.lower() not in suffixes:
        raise ModelSaveError(f"{what} {path!r} must end in {' or '.join(suffixes)}")
    if not target.parent.is_dir():
        raise ModelSaveError(f"cannot write {path!r}: folder {str(target.parent)!r} does not exist")
    return target


def npz_bytes(arrays: dict[str, Any]) -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def write_text(target: Path, text: str) -> None:
    write_bytes(target, text.encode("utf-8"))


def write_bytes(target: Path, data: bytes) -> None:
    """Write atomically: a failure never leaves a half-written file or clobbers an old one."""
    from placement.graph.atomic import write_file

    write_file(target, data)
