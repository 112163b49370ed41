"""``placement inspect MODEL``: inputs and outputs, per-device table, module scopes, parameters.

Example:
    $ placement inspect gpt --size tiny
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import placement as pl
from placement.cli.common import MODEL_HELP, SIZE_HELP, load_model_spec
from placement.cli.inputs import DEFAULT_DIM, index_bound, is_mask


def add_parser(sub: Any) -> None:
    """Add ``placement inspect`` and its options to ``sub`` (the command's subparsers)."""
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
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--size", default="tiny", help=SIZE_HELP)
    p.add_argument("--depth", type=int, default=2, help="module scope depth of the scope table (default 2)")
    p.add_argument("--top", type=int, default=10, help="largest parameters listed (default 10)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, console: Any) -> int:
    """Run ``placement inspect`` with the parsed ``args``, printing to ``console``; the exit status."""
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
        shape = tuple(d if isinstance(d, int) else DEFAULT_DIM for d in spec.shape)
        if spec.dtype.kind in "iub" and is_mask(spec.name):  # 1 = attend (a random 0/1 mask may hide a row)
            maker = f"np.ones({shape!r}, dtype='{spec.dtype}')"
        elif spec.dtype.kind in "iu":
            high = index_bound(model, spec.name) or 10
            maker = f"np.random.randint(0, {high}, {shape!r}).astype('{spec.dtype}')"
        elif spec.dtype.kind == "b":
            maker = f"np.random.rand(*{shape!r}) > 0.5"
        else:
            maker = f"np.random.rand(*{shape!r}).astype('{spec.dtype}')"
        lines.append(f"  python -c \"import numpy as np; np.save('{spec.name}.npy', {maker})\"")
    symbolic = sorted({str(d) for s in tensors for d in s.shape if not isinstance(d, int)})
    if symbolic:
        names = ", ".join(symbolic)
        tried = _sizes_tried(model, symbolic)
        lines.append(f"  (symbolic dimensions {names} set to {DEFAULT_DIM} here; {tried})")
    feeds = " ".join(f"--input {s.name}={s.name}.npy" for s in tensors)
    lines.append(f"then: placement run PLACED.onnx {feeds}")
    randoms = " ".join(f"--input {s.name}=random" for s in tensors)
    lines.append(f"or without files: placement run PLACED.onnx {randoms}")
    return lines


#: Models whose parameters take more than this are not run to try the sizes of their symbolic dimensions.
TRY_SIZES_MAX_BYTES = 256 * 2**20


def _sizes_tried(model: Any, symbols: list[str]) -> str:
    """What sizes of the symbolic dimensions the model really runs at: one CPU session run with
    every symbol at :data:`DEFAULT_DIM`, then at one more. An exporter may keep a dimension's
    name on the inputs yet fix its size inside the graph (TorchScript traces shapes into
    constants); a run says so, where the names alone would promise any size."""
    import onnxruntime as ort

    from placement.cli.inputs import read_inputs
    from placement.graph.session import ort_session
    from placement.runtime.inputs import normalize_inputs

    if sum(p.nbytes for p in model.parameters.values()) > TRY_SIZES_MAX_BYTES:
        return "sizes not tried (a large model)"
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort_session(model, options, ["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 (only a hint: a model ORT cannot build says so when run)
        return "sizes not tried (ONNX Runtime cannot build it on the CPU)"
    names = [i.name for i in session.get_inputs()]
    for size in (DEFAULT_DIM, DEFAULT_DIM + 1):
        try:
            feeds = read_inputs(None, model, random_rest=True, dims=dict.fromkeys(symbols, size))
            arrays = normalize_inputs(feeds, _io_specs(model)[0])
            session.run(None, dict(zip(names, arrays)))
        except Exception as err:  # noqa: BLE001 (reported as what the sizes do)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            if size == DEFAULT_DIM:
                return f"a run at size {size} failed, the export may have fixed these sizes: {first}"
            return (
                f"it ran at {DEFAULT_DIM} but not at {size}: the export fixed these sizes inside the graph, "
                f"use the sizes it was exported at ({first})"
            )
    return f"any size: it ran at {DEFAULT_DIM} and {DEFAULT_DIM + 1}"


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
