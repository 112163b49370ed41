"""The inputs of ``placement run`` and the planner: ``--input`` files, random inputs, ``--dim`` sizes.

Example:
    >>> from placement.cli.inputs import parse_dims
    >>> parse_dims(["batch=8", "seq=16,x=2"])
    {'batch': 8, 'seq': 16, 'x': 2}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import placement as pl

#: The size a symbolic dimension gets in random inputs and recipes unless ``--dim NAME=N`` says.
DEFAULT_DIM = 2


def index_bound(model: Any, name: str) -> int | None:
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


def is_mask(name: str) -> bool:
    """Whether an integer or boolean graph input is a mask (``attention_mask``, ``token_mask``):
    its values are 0/1, and made-up ones are all 1 (attend everywhere)."""
    return "mask" in name.lower()


def parse_dims(items: Sequence[str] | None) -> dict[str, int]:
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


def read_inputs(
    specs: Sequence[str] | None,
    model: Any,
    *,
    random_rest: bool = False,
    dims: dict[str, int] | None = None,
    default_dim: int = DEFAULT_DIM,
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
    given: dict[str, str] = {}

    def take(name: str, spec: str) -> None:
        if name not in names:
            raise pl.InputError(
                f"--input {spec!r}: the model has no input {name!r} (inputs: {', '.join(names)})"
            )
        if name in given:
            raise pl.InputError(
                f"input {name!r} is given twice: --input {given[name]!r} and --input {spec!r}"
            )
        given[name] = spec

    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep and spec.lower().endswith(".npz"):
            for name, array in _read_npz(spec).items():
                take(name, spec)
                arrays[name] = array
            continue
        if not sep:
            if len(names) != 1:
                raise pl.InputError(
                    f"--input {spec!r}: name the input (NAME=FILE.npy), or give one .npz with every "
                    f"input by name; inputs are {names}"
                )
            name, path = names[0], spec
        take(name, spec)
        if path == "random":
            random_names.append(name)
            continue
        try:
            arrays[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise pl.InputError(f"cannot read input {name!r} from {path!r}: {err}") from err
        if not isinstance(arrays[name], np.ndarray):
            raise pl.InputError(
                f"--input {spec!r}: {path!r} holds several arrays; give a .npy per input "
                "(NAME=FILE.npy), or the .npz alone (its arrays by input name)"
            )
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


def _read_npz(path: str) -> dict[str, Any]:
    """The arrays of an ``.npz`` file by name (what ``placement run --output`` and ``np.savez`` write)."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise pl.InputError(f"cannot read inputs from {path!r}: {err}") from err


def planner_inputs(args: Any, model: Any) -> tuple[dict[str, Any] | None, dict[str, int] | None]:
    """``(sample_inputs, batch)`` for the planner from ``--input`` and ``--dim``.

    Inputs the ``--input`` files leave out are made at random at the ``--dim`` sizes (1
    for a symbol ``--dim`` does not give); without ``--input`` the planner makes its own
    and ``--dim`` is the batch it plans for.
    """
    dims = parse_dims(getattr(args, "dim", None)) or None
    specs = getattr(args, "input", None)
    if not specs:
        return None, dims
    return read_inputs(specs, model, random_rest=True, dims=dims, default_dim=1), dims


def _random_input(model: Any, spec: Any, rng: Any, dims: dict[str, int], default_dim: int) -> Any:
    """Random data of ``spec``'s dtype and shape: normal floats, valid indices, fair booleans."""
    if spec.kind != "tensor" or spec.dtype is None or spec.shape is None:
        raise pl.InputError(
            f"input {spec.name!r} ({spec.describe() if spec.kind == 'tensor' else spec.kind}) has no "
            "known tensor type and shape: give it as a file (--input NAME=FILE.npy)"
        )
    shape = tuple(d if isinstance(d, int) else dims.get(str(d), default_dim) for d in spec.shape)
    if spec.dtype.kind in "iub" and is_mask(spec.name):
        return rng.integers(1, 2, shape).astype(spec.dtype)  # all ones
    if spec.dtype.kind in "iu":
        return rng.integers(0, index_bound(model, spec.name) or 10, shape).astype(spec.dtype)
    if spec.dtype.kind == "b":
        return rng.random(shape) < 0.5
    if spec.dtype.kind in "fc":
        return rng.standard_normal(shape).astype(spec.dtype)
    raise pl.InputError(f"input {spec.name!r} is {spec.dtype}: give it as a file (--input NAME=FILE.npy)")
