"""The ``placement`` command.

Subcommands::

    placement models                         list the built-in models
    placement inspect MODEL                  inputs (dtype, shape), per-device table, scopes, parameters
    placement plan MODEL -o PLAN.json        plan a placement (devices, memory budgets) without placing
    placement place MODEL -o OUT.onnx        place a model (equal split, --auto, or --plan) and save it
    placement run PLACED.onnx --input x=x.npy --output out.npz
                                             run a placed model, print latency and where stages ran
                                             (--input x=random or --random-inputs: no files needed)
    placement draw MODEL -o placed.svg       picture of the graph coloured by device (svg/png/pdf/dot)
    placement report MODEL -o report.html    one self-contained HTML page: tables, charts, the graph
    placement demo                           the main job: place the default model on 2 devices,
                                             run it through ONNX Runtime and torch, check outputs
    placement launch PLACED.onnx ...         run a placed model as torch.distributed ranks (torchrun)

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
import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import placement as pl
from placement.errors import PlacementError

__all__ = ["main", "build_parser", "load_model_spec"]

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (like every other error of the command)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


@contextlib.contextmanager
def _step(console: Any, description: str) -> Iterator[None]:
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
    step = (lambda text: _step(console, text)) if console is not None else (lambda text: _nothing())
    path = Path(spec)
    if path.suffix == ".onnx" or path.exists():
        with step(f"loading {spec}"):
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
    with step(f"exporting {spec} ({size}) to ONNX" + (" with a dynamic batch" if dynamic_batch else "")):
        return pl.from_torch(net, args, dynamic_shapes=shapes), net, args


def batch_dynamic_shapes(args: Sequence[Any]) -> tuple[Any, ...]:
    """``dynamic_shapes`` for :func:`placement.from_torch` making axis 0 of every input ``batch``.

    Example:
        >>> import torch
        >>> from placement.cli import batch_dynamic_shapes
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


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _parse_max_memory(text: str | None) -> dict[str, str] | None:
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


def _check_output(path: str, suffixes: Sequence[str], what: str) -> Path:
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


def _auto_plan(model: Any, args: argparse.Namespace, console: Any) -> Any:
    """Run the planner on ``model`` (in place) from --devices / --max-memory / --cost / --objective."""
    budgets = _parse_max_memory(getattr(args, "max_memory", None))
    devices = args.devices if args.devices is not None or budgets is None else None
    if devices is None and budgets is None:
        devices = 2
    if isinstance(devices, int) and devices < 1:
        raise pl.PlanError(f"--devices must be at least 1, got {devices}")
    runtime = getattr(args, "runtime", "ort")
    if getattr(args, "calibrate", False):
        if args.cost != "time" or args.objective != "throughput":
            raise pl.PlanError(
                "--calibrate times the plan's stages: use it with --cost time and --objective throughput"
            )
        what = "ONNX Runtime stage sessions" if runtime == "ort" else "lowered torch stages"
        with _step(console, f"profiling, planning and timing {what} (calibration)"):
            return pl.calibrate(model, devices, budgets, runtime=runtime).plan
    what = "profiling and planning" if args.cost == "time" else "planning"
    with _step(console, f"{what} ({args.cost} cost, {args.objective}, for {runtime})"):
        return pl.auto_place(
            model, devices, budgets, cost=args.cost, objective=args.objective, runtime=runtime
        )


def _is_placed(model: Any) -> bool:
    return len(model.devices) > 1 or any(op.is_copy for op in model.iter_ops())


def _wants_planner(args: argparse.Namespace) -> bool:
    """Whether the options ask for the automatic planner (--auto, --max-memory or --calibrate)."""
    return bool(args.auto or args.max_memory or args.calibrate)


def _wants_placement(args: argparse.Namespace) -> bool:
    """Whether the options ask to place the model (a split, the planner or a saved plan)."""
    return args.devices is not None or bool(args.plan) or _wants_planner(args)


def _place(model: Any, args: argparse.Namespace, console: Any, *, default_split: int | None) -> Any:
    """Place ``model`` as the options say; returns the plan (or None). Copies are injected."""
    plan = None
    if getattr(args, "plan", None):
        if _wants_planner(args):
            raise pl.PlanError("--plan applies a saved plan: leave out --auto, --max-memory and --calibrate")
        plan = pl.Plan.load(args.plan)
        plan.apply(model)
    elif _wants_planner(args):
        plan = _auto_plan(model, args, console)
    elif args.devices is not None or default_split is not None:
        count = args.devices if args.devices is not None else default_split
        if count < 1:
            raise pl.PlanError(f"--devices must be at least 1, got {count}")
        pl.place_evenly(model, count, copies=False)
    with _step(console, "injecting copies"):
        pl.inject_cross_device_copies(model)
        pl.verify(model)
    return plan


# --- sub-commands -------------------------------------------------------------------


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
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    summary = pl.summary(model)
    if args.json:
        data = summary.to_dict()
        data["scopes"] = [
            {"scope": scope, "ops": counts} for scope, counts in _scope_counts(model, args.depth).items()
        ]
        inputs, outputs = _io_specs(model)
        data["inputs"], data["outputs"] = ([_spec_dict(x) for x in specs] for specs in (inputs, outputs))
        data["parameters"] = [
            {"name": p.name, "device": str(p.device), "shape": list(p.shape), "bytes": p.nbytes}
            for p in model.parameters.values()
        ]
        console.print_json(data=data)
        return 0
    console.print(f"[bold]{args.model}[/bold]: {model!r}", highlight=False)
    console.print(_io_table(model))
    for line in _input_recipe(model):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(summary.to_table())
    console.print(_scope_table(model, args.depth))
    console.print(_parameter_table(model, args.top))
    return 0


def _spec_dict(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "dtype": str(spec.dtype), "shape": list(spec.shape or ()), "kind": spec.kind}


def _io_specs(model: Any) -> tuple[list[Any], list[Any]]:
    """Input and output specs (name, dtype, dims with symbolic names) of ``model``'s graph."""
    from placement.runtime.inputs import InputSpec, input_specs

    graph = model.graph
    outputs = []
    for value in graph.outputs:
        dtype = None
        if value.dtype is not None:
            with contextlib.suppress(Exception):
                import numpy as np

                dtype = np.dtype(value.dtype.numpy())
        shape = None
        if value.shape is not None:
            shape = tuple(d if isinstance(d, int) else getattr(d, "value", None) for d in value.shape)
        outputs.append(InputSpec(value.name or "", dtype, shape))
    return input_specs(graph), outputs


def _io_table(model: Any) -> Any:
    from rich.markup import escape
    from rich.table import Table

    inputs, outputs = _io_specs(model)
    table = Table(title="graph inputs and outputs (symbolic dimensions by name, ? if unnamed)")
    for column in ("", "name", "dtype", "shape"):
        table.add_column(column)
    for role, specs in (("input", inputs), ("output", outputs)):
        for spec in specs:
            dtype, _, shape = spec.describe().partition("[")
            table.add_row(role, spec.name, dtype, escape("[" + shape if spec.kind == "tensor" else spec.kind))
    return table


def _input_recipe(model: Any) -> list[str]:
    """Lines saying how to make input files for ``placement run`` (or run on random inputs)."""
    inputs, _ = _io_specs(model)
    tensors = [s for s in inputs if s.kind == "tensor" and s.dtype is not None and s.shape is not None]
    if not tensors:
        return []
    lines = ["make an input file per graph input, e.g. with numpy:"]
    for spec in tensors:
        shape = tuple(d if isinstance(d, int) else _DEFAULT_DIM for d in spec.shape)
        if spec.dtype.kind in "iu":
            high = _index_bound(model, spec.name) or 10
            maker = f"np.random.randint(0, {high}, {shape!r}).astype('{spec.dtype}')"
        elif spec.dtype.kind == "b":
            maker = f"np.random.rand(*{shape!r}) > 0.5"
        else:
            maker = f"np.random.rand(*{shape!r}).astype('{spec.dtype}')"
        lines.append(f"  python -c \"import numpy as np; np.save('{spec.name}.npy', {maker})\"")
    symbolic = sorted({str(d) for s in tensors for d in s.shape if not isinstance(d, int)})
    if symbolic:
        names = ", ".join(symbolic)
        lines.append(f"  (symbolic dimensions {names} set to {_DEFAULT_DIM} here; any size works)")
    feeds = " ".join(f"--input {s.name}={s.name}.npy" for s in tensors)
    lines.append(f"then: placement run PLACED.onnx {feeds}")
    randoms = " ".join(f"--input {s.name}=random" for s in tensors)
    lines.append(f"or without files: placement run PLACED.onnx {randoms}")
    return lines


#: The size a symbolic dimension gets in random inputs and recipes unless ``--dim NAME=N`` says.
_DEFAULT_DIM = 2


def _index_bound(model: Any, name: str) -> int | None:
    """The row count of the table graph input ``name`` indexes through a Gather (via copies), if any."""
    names, bounds = {name}, []
    for op in model.iter_ops():  # topological order: a copy of the input comes before its readers
        node = op.node
        if op.is_copy or node.op_type == "Identity":
            if node.inputs and node.inputs[0] is not None and node.inputs[0].name in names:
                names.update(v.name for v in node.outputs)
            continue
        if node.op_type != "Gather" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        table = node.inputs[0]
        if node.inputs[1].name not in names or table is None or table.shape is None:
            continue
        axis = node.attributes["axis"].value if "axis" in node.attributes else 0
        axis = axis + len(table.shape) if axis < 0 else axis
        if 0 <= axis < len(table.shape) and isinstance(table.shape[axis], int):
            bounds.append(table.shape[axis])
    return min(bounds) if bounds else None


def _scope_counts(model: Any, depth: int) -> dict[str, dict[str, int]]:
    from placement.report.dot import scope_of

    counts: dict[str, dict[str, int]] = {}
    for op in model.iter_ops():
        if op.is_copy:
            continue
        scope = scope_of(op.node)
        key = ".".join(scope.split(".")[:depth]) if scope else "(top level)"
        per_device = counts.setdefault(key, {})
        per_device[str(op.device)] = per_device.get(str(op.device), 0) + 1
    return counts


def _scope_table(model: Any, depth: int) -> Any:
    from rich.table import Table

    counts = _scope_counts(model, depth)
    devices = [str(d) for d in model.devices]
    if list(counts) == ["(top level)"]:
        return "no module scopes in this model (its exporter recorded none): ops by device above"
    table = Table(title=f"ops per module scope (depth {depth}) and device")
    table.add_column("scope")
    for device in devices:
        table.add_column(device, justify="right")
    for scope, per_device in counts.items():
        table.add_row(scope, *(str(per_device.get(d, "")) for d in devices))
    return table


def _parameter_table(model: Any, top: int) -> Any:
    from rich.table import Table

    from placement.graph.sizes import format_bytes

    params = sorted(model.parameters.values(), key=lambda p: -p.nbytes)
    if not params:
        return "no parameters"
    table = Table(title=f"where parameters live ({min(top, len(params))} largest of {len(params)})")
    for column in ("parameter", "device", "shape", "dtype", "size"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for p in params[:top]:
        table.add_row(
            p.name, str(p.device), "x".join(map(str, p.shape)) or "scalar", p.dtype, format_bytes(p.nbytes)
        )
    return table


def _cmd_plan(args: argparse.Namespace, console: Any) -> int:
    target = _check_output(args.output, [".json"], "the plan file")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    if any(op.is_copy for op in model.iter_ops()):
        raise pl.PlanError(f"{args.model} already has copies (it is placed): plan the unplaced model")
    plan = _auto_plan(model, args, console)
    console.print(plan.to_table())
    _write_text(target, plan.to_json())
    console.print(f"saved {target}")
    return 0


def _cmd_place(args: argparse.Namespace, console: Any) -> int:
    target = _check_output(args.output, [".onnx"], "the placed model")
    model, _, _ = load_model_spec(
        args.model, size=args.size, console=console, dynamic_batch=args.dynamic_batch
    )
    plan = _place(model, args, console, default_split=2)
    if plan is not None:
        console.print(plan.to_table())
    with _step(console, f"saving {target}"):
        model.save(target)
    console.print(pl.summary(model).to_table())
    console.print(f"saved {target}")
    return 0


def _cmd_run(args: argparse.Namespace, console: Any) -> int:
    import numpy as np

    target = _check_output(args.output, [".npz"], "the output file") if args.output else None
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
    inputs = _read_inputs(
        args.input,
        model,
        random_rest=args.random_inputs,
        dims=_parse_dims(args.dim),
        default_dim=_DEFAULT_DIM * (args.chunks or 1),
    )
    with _step(console, "building ONNX Runtime sessions"):
        runner = pl.Runner(model, **options)
    with _step(console, "first run (warm-up)"):
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
        buffer = _npz_bytes(dict(zip(runner.output_names, outputs)))
        _write_bytes(target, buffer)
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
            str(stage.device),
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


def _parse_dims(items: Sequence[str] | None) -> dict[str, int]:
    """``["batch=8", "seq=16,x=2"]`` -> ``{"batch": 8, "seq": 16, "x": 2}``."""
    dims: dict[str, int] = {}
    for item in ",".join(items or ()).split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            size = int(value)
        except ValueError:
            size = -1
        if not sep or not name.strip() or size < 1:
            raise pl.InputError(f"bad --dim item {item!r}: use NAME=N with N >= 1, e.g. batch=8")
        dims[name.strip()] = size
    return dims


def _read_inputs(
    specs: Sequence[str] | None,
    model: Any,
    *,
    random_rest: bool = False,
    dims: dict[str, int] | None = None,
    default_dim: int = _DEFAULT_DIM,
) -> dict[str, Any]:
    """``["x=x.npy", "y=random"]`` -> ``{"x": array, "y": array}``; a single input may be ``x.npy``.

    ``NAME=random`` (or ``random_rest`` for every input not named) makes random data of the
    input's dtype and shape; symbolic dimensions take ``dims[name]``, else ``default_dim``.
    """
    import numpy as np

    from placement.runtime.inputs import input_specs

    names = model.inputs
    if not specs and not random_rest:
        raise pl.InputError(
            f"give the model's inputs with --input NAME=FILE.npy or NAME=random, or --random-inputs "
            f"(it reads {', '.join(names)}; 'placement inspect' shows their shapes)"
        )
    by_name = {spec.name: spec for spec in input_specs(model.graph)}
    wanted = dict(dims or {})
    arrays: dict[str, Any] = {}
    random_names: list[str] = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep:
            if len(names) != 1:
                raise pl.InputError(f"--input {spec!r}: name the input (NAME=FILE.npy); inputs are {names}")
            name, path = names[0], spec
        if name not in names:
            raise pl.InputError(
                f"--input {spec!r}: the model has no input {name!r} (inputs: {', '.join(names)})"
            )
        if path == "random":
            random_names.append(name)
            continue
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise pl.InputError(f"cannot read input {name!r} from {path!r}: {err}") from err
        if not isinstance(arrays[name], np.ndarray):
            raise pl.InputError(f"input file {path!r} holds several arrays; give one .npy per input")
    if random_rest:
        random_names += [n for n in names if n not in arrays and n not in random_names]
    symbolic = {str(d) for n in random_names for d in (by_name[n].shape or ()) if not isinstance(d, int)}
    unknown = sorted(set(wanted) - symbolic)
    if unknown:
        known = ", ".join(sorted(symbolic)) or "none"
        raise pl.InputError(
            f"--dim {', '.join(unknown)}: not a symbolic dimension of the random inputs (theirs: {known})"
        )
    rng = np.random.default_rng(0)
    for name in random_names:
        arrays[name] = _random_input(model, by_name[name], rng, wanted, default_dim)
    return arrays


def _random_input(model: Any, spec: Any, rng: Any, dims: dict[str, int], default_dim: int) -> Any:
    """Random data of ``spec``'s dtype and shape: normal floats, valid indices, fair booleans."""
    if spec.kind != "tensor" or spec.dtype is None or spec.shape is None:
        raise pl.InputError(
            f"input {spec.name!r} ({spec.describe() if spec.kind == 'tensor' else spec.kind}) has no "
            "known tensor type and shape: give it as a file (--input NAME=FILE.npy)"
        )
    shape = tuple(d if isinstance(d, int) else dims.get(str(d), default_dim) for d in spec.shape)
    if spec.dtype.kind in "iu":
        return rng.integers(0, _index_bound(model, spec.name) or 10, shape).astype(spec.dtype)
    if spec.dtype.kind == "b":
        return rng.random(shape) < 0.5
    if spec.dtype.kind in "fc":
        return rng.standard_normal(shape).astype(spec.dtype)
    raise pl.InputError(f"input {spec.name!r} is {spec.dtype}: give it as a file (--input NAME=FILE.npy)")


def _npz_bytes(arrays: dict[str, Any]) -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _write_text(target: Path, text: str) -> None:
    _write_bytes(target, text.encode("utf-8"))


def _write_bytes(target: Path, data: bytes) -> None:
    """Write atomically: a failure never leaves a half-written file or clobbers an old one."""
    from placement.graph.atomic import write_file

    write_file(target, data)


def _collapse_option(text: str) -> bool | str:
    return {"auto": "auto", "yes": True, "no": False}[text]


def _cmd_draw(args: argparse.Namespace, console: Any) -> int:
    from placement.report.draw import FORMATS

    target = _check_output(args.output, list(FORMATS), "the picture")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    if _wants_placement(args):
        _place(model, args, console, default_split=None)
    with _step(console, f"drawing {len(model.ops)} ops with Graphviz"):
        drawing = pl.draw(model, target, collapse=_collapse_option(args.collapse), max_nodes=args.max_nodes)
    per_device = ", ".join(f"{d}: {n} ops" for d, n in drawing.ops_per_device.items())
    kind = "collapsed to " if drawing.collapsed else ""
    console.print(f"{per_device}; {kind}{drawing.boxes} boxes, {drawing.copy_edges} copy edges")
    if drawing.note:
        console.print(f"[yellow]note:[/yellow] {drawing.note}", highlight=False)
    console.print(f"saved {drawing.path}")
    return 0


def _cmd_report(args: argparse.Namespace, console: Any) -> int:
    target = _check_output(args.output, [".html", ".htm"], "the report")
    model, _, _ = load_model_spec(args.model, size=args.size, console=console)
    plan = None
    if _wants_placement(args) or not _is_placed(model):
        if any(op.is_copy for op in model.iter_ops()):
            raise pl.PlanError(f"{args.model} is already placed: report it as it is (leave out --devices)")
        if args.plan:
            plan = pl.Plan.load(args.plan)
            plan.apply(model)
        else:
            plan = _auto_plan(model, args, console)
        pl.inject_cross_device_copies(model)
    with _step(console, "writing the report (charts, graph picture)"):
        report = pl.write_report(model, target, plan=plan)
    if plan is not None:
        console.print(plan.to_table())
    if report.drawing.note:
        console.print(f"[yellow]note:[/yellow] {report.drawing.note}", highlight=False)
    console.print(f"saved {target}")
    return 0


def _cmd_demo(args: argparse.Namespace, console: Any) -> int:
    from placement.demo import run_demo

    result = run_demo(
        args.model, size=args.size, devices=args.devices, console=console, precision=args.precision
    )
    return 0 if result.ok else 1


def _cmd_launch(args: argparse.Namespace, console: Any) -> int:
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

    if single or args.input:  # on several nodes only the one running rank 0 needs the inputs
        read_inputs(args.input, model.inputs)
    if args.output:
        _check_output(args.output, [".npz"], "the output file")
    check_threads(args.threads, what="--threads")
    for flag in ("chunks", "timeout"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise pl.InputError(f"--{flag} must be positive, got {value}")


# --- the parser ---------------------------------------------------------------------

_SIZE_HELP = "size of a built-in model: tiny (tests) or bench (benchmarks); default tiny"
_MODEL_HELP = "an .onnx file or a built-in model name (see 'placement models')"


def _add_planner_options(p: argparse.ArgumentParser, *, devices_default: int | None) -> None:
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
        default="size",
        choices=["time", "size", "flops"],
        help="planner cost: measured time, parameter+output bytes, or FLOPs (default size)",
    )
    p.add_argument(
        "--objective",
        default="throughput",
        choices=["throughput", "latency"],
        help="planner objective (default throughput: smallest bottleneck)",
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


def _add_place_options(p: argparse.ArgumentParser) -> None:
    _add_planner_options(p, devices_default=None)
    p.add_argument("--auto", action="store_true", help="place with the automatic planner (pl.auto_place)")
    p.add_argument("--plan", metavar="PLAN.json", help="apply a plan saved by 'placement plan'")


def _add_models(sub: Any) -> None:
    p = sub.add_parser(
        "models",
        help="list the built-in models",
        description="List the built-in models (usable as MODEL in every command, and in 'demo').",
        epilog="Example: placement models",
    )
    p.set_defaults(func=_cmd_models)


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="inputs and outputs, per-device table, module scopes and parameters of a model",
        description=(
            "Print MODEL's graph inputs and outputs (name, dtype, shape with symbolic dimensions by "
            "name) with a numpy one-liner making an input file for 'placement run', a per-device "
            "table (ops, parameter bytes, activations, copies), its ops per module scope and device "
            "(scopes recorded by the exporter, or read from '/a/b/Op' op names of other exporters), "
            "and where its largest parameters live."
        ),
        epilog="Example: placement inspect gpt   |   placement inspect placed.onnx --json",
    )
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.add_argument("--depth", type=int, default=2, help="module scope depth of the scope table (default 2)")
    p.add_argument("--top", type=int, default=10, help="largest parameters listed (default 10)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=_cmd_inspect)


def _add_plan(sub: Any) -> None:
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
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="path of the plan .json file to write")
    _add_planner_options(p, devices_default=None)
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.set_defaults(func=_cmd_plan)


def _add_place(sub: Any) -> None:
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
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="path of the placed .onnx file to write")
    _add_place_options(p)
    p.add_argument(
        "--dynamic-batch",
        action="store_true",
        help="export a built-in model with a symbolic batch dimension (axis 0 of every input), so "
        "'placement run --chunks K' can pipeline it and any batch size runs",
    )
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.set_defaults(func=_cmd_place)


def _add_run(sub: Any) -> None:
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
        f"{_DEFAULT_DIM}, or {_DEFAULT_DIM} x K with --chunks K)",
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
    p.set_defaults(func=_cmd_run)


def _add_draw(sub: Any) -> None:
    p = sub.add_parser(
        "draw",
        help="draw the operator graph coloured by device (svg, png, pdf or dot)",
        description=(
            "Draw MODEL's operator graph with Graphviz: ops coloured by device, copies as red dashed "
            "edges labelled with their bytes, module scopes as clusters; big graphs collapse to one box "
            "per module and device. Place it first with --devices/--auto/--max-memory/--plan (as in "
            "'place'), or draw a placed .onnx as it is. Without Graphviz's dot, a .dot file is written."
        ),
        epilog="Example: placement draw gpt --devices 2 -o placed.svg | placement draw placed.onnx -o p.png",
    )
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    _add_place_options(p)
    p.add_argument(
        "--collapse",
        default="auto",
        choices=["auto", "yes", "no"],
        help="one box per module scope and device (auto: when the graph has more than --max-nodes ops)",
    )
    p.add_argument("--max-nodes", type=int, default=120, help="most boxes when collapsed (default 120)")
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.set_defaults(func=_cmd_draw)


def _add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="write one self-contained HTML report (tables, charts, graph picture)",
        description=(
            "Plan MODEL for --devices N (and --max-memory budgets) with the automatic planner, or take "
            "a placed .onnx as it is, and write one HTML page without external resources: the "
            "per-device table, time and memory per device against the budgets, bytes copied per cut, "
            "the planner's bottleneck against its lower bound, and the graph picture."
        ),
        epilog="Example: placement report gpt --devices 2 --max-memory 0=1MiB,1=1MiB -o report.html",
    )
    p.add_argument("model", metavar="MODEL", help=_MODEL_HELP)
    p.add_argument("-o", "--output", required=True, help="the .html file to write")
    _add_place_options(p)
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.set_defaults(func=_cmd_report)


def _add_demo(sub: Any) -> None:
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
    p.add_argument("--size", default="tiny", help=_SIZE_HELP)
    p.add_argument("--devices", type=int, default=2, help="number of logical GPUs (default 2)")
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "tf32"],
        help="fp32: TF32 off on GPUs, strict check (default); tf32: TF32 on, checked with its tolerance",
    )
    p.set_defaults(func=_cmd_demo)


def _add_launch(sub: Any) -> None:
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
    p.add_argument("--chunks", type=int, default=None, help="micro-batches (default: rows / graph batch)")
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
    p.set_defaults(func=_cmd_launch)


#: Each sub-command's parser, in the order ``placement --help`` lists them.
_COMMANDS = (
    _add_models,
    _add_inspect,
    _add_plan,
    _add_place,
    _add_run,
    _add_draw,
    _add_report,
    _add_demo,
    _add_launch,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``placement`` command."""
    parser = _Parser(
        prog="placement",
        description="Split neural networks across devices at the operator-graph level.",
        epilog="Run 'placement COMMAND --help' for the options of each command.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
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
        from placement import models

        args.model = models.DEFAULT_MODEL
    try:
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


if __name__ == "__main__":
    sys.exit(main())
