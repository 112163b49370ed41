"""What ``from_torch`` hands the exporter so that models in the wild export as configured.

Two small tables, each entry one known gap between a library's default and what
``torch.onnx.export`` (dynamo) can export:

* :data:`TRANSLATIONS`: custom ops with no ONNX function in the exporter's library, and
  the ONNX translation used for them (``custom_translation_table``). Hugging Face's
  mixture-of-experts layers (Mixtral, Qwen2-MoE, ... in their default ``"grouped_mm"``
  experts implementation) call ``torch.ops.transformers.grouped_mm_fallback`` (or
  ``aten._grouped_mm`` for bfloat16 weights) under ``torch.export``; it becomes one
  ``Slice`` of the expert-sorted rows, one ``Gather`` of the expert's weight and one
  ``MatMul`` per expert, joined by a ``Concat``. Each expert's ops carry the scope
  ``<experts module>.<expert index>``, so experts of one layer can be placed apart
  (``pl.assign_modules(model, {"...mlp.experts.3": 1})``). Their routers count tokens per
  expert with ``aten.histc``, which some torch releases' exporters lack: it becomes a
  one-hot count (:func:`histc`). ``aten.as_strided`` with static sizes becomes a
  ``Reshape``, ``Slice`` or ``Gather`` of constant indices (:func:`as_strided`): some
  onnxscript releases write a ``Loop`` over a sequence, which ``to_torch`` cannot lower
  (torch 2.11 decomposes ``AdaptiveAvgPool2d`` in ConvNeXt and Swin to such a view).
* :data:`EXPORTABLE_SETTINGS`: module settings whose value cannot be exported, and the
  exportable value used instead, per exporter (``experts_implementation="eager"``
  stops ``torch.export`` on a data-dependent guard; the dynamo exporter gets
  ``"grouped_mm"``, which exports through the translation above, the TorchScript
  exporter ``"batched_mm"``). Inside :func:`exportable_settings` the module runs with the
  replacement, a one-line notice is logged, and the user's setting is restored on exit,
  even when the export fails. Hugging Face causal language models default to
  ``use_cache=True``: their forward returns a ``DynamicCache``, which neither exporter
  can return; a plain forward is exported with ``use_cache=False`` (the logits are the
  same). :func:`placement.graph.causal_lm.from_causal_lm` exports the cache instead.

Example:
    >>> import torch
    >>> with exportable_settings(torch.nn.Linear(2, 2)) as changed:
    ...     changed
    []
    >>> TRANSLATIONS["transformers::grouped_mm_fallback"].__name__
    'grouped_mm'
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPERT_KEY",
    "EXPORTABLE_SETTINGS",
    "TRANSLATIONS",
    "Setting",
    "as_strided",
    "exportable_settings",
    "grouped_mm",
    "histc",
    "translation_table",
]

log = logging.getLogger(__name__)

#: Node metadata key a translation sets on the ops of one expert (its index); the
#: importer appends it to the op's scope (``<experts module>.<index>``) and keeps it
#: (:func:`placement.planning.experts.spread_experts` reads it).
EXPERT_KEY = "placement.expert"


def grouped_mm(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """ONNX translation of a grouped matmul (``aten._grouped_mm``, ``transformers::grouped_mm_fallback``).

    ``mat_a`` is ``(S, K)`` with its rows sorted by group, ``mat_b`` is ``(G, K, N)``
    and ``offs`` ``(G,)`` the cumulative row count at the end of each group: row ``r``
    of the ``(S, N)`` result is ``mat_a[r] @ mat_b[group(r)]``. The number of groups
    (experts) must be static; each gets its own ``Slice``/``Gather``/``MatMul``,
    tagged with its index (:data:`EXPERT_KEY`). Called by the exporter with
    onnxscript values, not by users.
    """
    from onnxscript.onnx_opset import opset18 as op

    ranks = [None if v.shape is None else len(v.shape) for v in (mat_a, mat_b)]
    if ranks != [2, 3] or offs is None:  # the other grouped-matmul modes (3-D x 3-D, 2-D x 2-D)
        raise ValueError(
            f"grouped_mm: only (rows, K) x (groups, K, N) with offsets is translated, got ranks {ranks}"
        )
    groups = mat_b.shape[0]
    if not isinstance(groups, int):
        raise ValueError("grouped_mm: the number of groups (experts) must be static to export it")
    axes = op.Constant(value_ints=[0])
    ends_all = op.Cast(offs, to=7)  # INT64
    ends = op.Split(ends_all, axis=0, num_outputs=groups) if groups > 1 else [ends_all]
    start = op.Constant(value_ints=[0])
    outputs = []
    for g in range(groups):
        rows = _tag(op.Slice(mat_a, start, ends[g], axes), g)
        weight = _tag(op.Gather(mat_b, op.Constant(value_int=g), axis=0), g)  # (K, N)
        out = _tag(op.MatMul(rows, weight), g)
        if bias is not None:
            out = _tag(op.Add(out, _tag(op.Gather(bias, op.Constant(value_int=g), axis=0), g)), g)
        outputs.append(out)
        start = ends[g]
    result = op.Concat(*outputs, axis=0) if groups > 1 else outputs[0]
    if out_dtype is not None:
        result = op.Cast(result, to=_onnx_dtype(out_dtype))
    return result


def histc(values: Any, bins: int = 100, min: float = 0.0, max: float = 0.0) -> Any:  # noqa: A002
    """ONNX translation of ``aten.histc``: counts of ``values`` in ``bins`` equal bins over ``[min, max]``.

    Mixture-of-experts routers count the tokens per expert with it (``torch.histc(ids, bins=E,
    min=0, max=E - 1)``); some torch releases' exporters have no function for it. As in torch,
    values outside ``[min, max]`` are not counted, ``max`` falls in the last bin, and ``min ==
    max`` takes the data's range (widened by 1 on both sides when that is empty too). Called by
    the exporter with onnxscript values, not by users.
    """
    from onnxscript.onnx_opset import opset18 as op

    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"histc: the number of bins must be a static positive integer, got {bins!r}")
    flat = op.Cast(op.Reshape(values, op.Constant(value_ints=[-1])), to=1)  # FLOAT
    if min == max:
        low, high = op.ReduceMin(flat, keepdims=0), op.ReduceMax(flat, keepdims=0)
        empty = op.Cast(op.Equal(low, high), to=1)
        low, high = op.Sub(low, empty), op.Add(high, empty)
    else:
        low, high = op.Constant(value_float=float(min)), op.Constant(value_float=float(max))
    scaled = op.Div(op.Mul(op.Sub(flat, low), op.Constant(value_float=float(bins))), op.Sub(high, low))
    index = op.Min(op.Cast(op.Floor(scaled), to=7), op.Constant(value_int=bins - 1))  # INT64
    inside = op.And(op.GreaterOrEqual(flat, low), op.LessOrEqual(flat, high))
    edges = op.Range(op.Constant(value_int=0), op.Constant(value_int=bins), op.Constant(value_int=1))
    hits = op.And(
        op.Equal(op.Unsqueeze(index, op.Constant(value_ints=[1])), edges),
        op.Unsqueeze(inside, op.Constant(value_ints=[1])),
    )
    counts = op.ReduceSum(op.Cast(hits, to=1), op.Constant(value_ints=[0]), keepdims=0)
    return op.CastLike(counts, values)


def as_strided(self: Any, size: Any, stride: Any, storage_offset: Any = None) -> Any:
    """ONNX translation of ``aten.as_strided``: one ``Reshape``, ``Slice`` or ``Gather``, no ``Loop``.

    ONNX tensors have no storage, so as in the exporter's own function the view reads ``self``
    flattened in row-major order: output element ``(i_0, ...)`` is ``flat[offset + sum(i_d *
    stride_d)]``. With static sizes and strides the flat indices are computed here: a view that
    reads consecutive elements (``AdaptiveAvgPool2d`` decomposes to a ``mean`` and such a view
    in some torch releases) becomes a ``Reshape`` (a ``Slice`` first where it reads fewer
    elements), any other a ``Gather`` of constant indices. Some onnxscript releases write a
    ``Loop`` over a sequence instead, which ``to_torch`` cannot lower. Symbolic sizes go to the
    exporter's function. Called by the exporter with onnxscript values, not by users.
    """
    import numpy as np
    from onnxscript.onnx_opset import opset18 as op

    offset = 0 if storage_offset is None else storage_offset
    static = [*size, *stride, offset]
    if not all(isinstance(v, int | np.integer) for v in static):
        from onnxscript.function_libs.torch_lib.ops.core import aten_as_strided

        if storage_offset is None:
            return aten_as_strided(self, size, stride)
        return aten_as_strided(self, size, stride, storage_offset)
    size, stride, offset = [int(v) for v in size], [int(v) for v in stride], int(offset)
    index = np.full(size, offset, dtype=np.int64)
    for dim, (count, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[dim] = count
        index = index + np.arange(count, dtype=np.int64).reshape(shape) * step
    total = int(index.size)
    flat = op.Reshape(self, op.Constant(value_ints=[-1]))
    if total and np.array_equal(index.ravel(), np.arange(offset, offset + total)):
        dims = None if self.shape is None else list(self.shape)
        whole = dims is not None and all(isinstance(d, int) for d in dims) and int(np.prod(dims)) == total
        if not whole:
            flat = op.Slice(
                flat,
                op.Constant(value_ints=[offset]),
                op.Constant(value_ints=[offset + total]),
                op.Constant(value_ints=[0]),
            )
        return op.Reshape(flat, op.Constant(value_ints=size))
    import onnx_ir as ir

    return op.Gather(flat, op.Constant(value=ir.tensor(index)), axis=0)


def _tag(value: Any, group: int) -> Any:
    """Mark the node producing ``value`` as part of expert ``group``."""
    producer = getattr(value, "producer", None)
    node = producer() if callable(producer) else None
    if node is not None:
        node.metadata_props[EXPERT_KEY] = str(group)
    return value


def _onnx_dtype(dtype: Any) -> int:
    """An ONNX data type number from a torch dtype (or a number the exporter already converted)."""
    if isinstance(dtype, int):
        return dtype
    import onnx_ir as ir
    import torch

    table = {
        torch.float32: ir.DataType.FLOAT,
        torch.float16: ir.DataType.FLOAT16,
        torch.bfloat16: ir.DataType.BFLOAT16,
        torch.float64: ir.DataType.DOUBLE,
    }
    if dtype not in table:
        raise ValueError(f"grouped_mm: unsupported out_dtype {dtype}")
    return int(table[dtype].value)


#: Custom op (``"namespace::name"``, its default overload) -> ONNX translation.
TRANSLATIONS: dict[str, Callable[..., Any]] = {
    "aten::as_strided": as_strided,
    "aten::histc": histc,
    "aten::_grouped_mm": grouped_mm,
    "transformers::grouped_mm_fallback": grouped_mm,
}


def translation_table() -> dict[Any, Callable[..., Any]]:
    """:data:`TRANSLATIONS` keyed by the ``OpOverload`` s registered in this process.

    Ops whose library is not loaded (no ``transformers``) are left out.
    """
    import torch

    table: dict[Any, Callable[..., Any]] = {}
    for qualified, function in TRANSLATIONS.items():
        namespace, name = qualified.split("::")
        try:
            overload = getattr(getattr(torch.ops, namespace), name).default
        except (AttributeError, RuntimeError):
            continue
        table[overload] = function
    return table


@dataclass(frozen=True)
class Setting:
    """A module setting that may hold a non-exportable value.

    ``applies(module)`` says whether ``module`` has the setting; ``get``/``put`` read
    and write it (``get``'s value is what ``put`` restores; a ``dict`` value holds one
    entry per sub-configuration); ``exportable[exporter]`` are the values that
    exporter (``"dynamo"``, ``"torchscript"``) can export; ``replacement[exporter]``
    is the value used instead.
    """

    name: str
    applies: Callable[[Any], bool]
    get: Callable[[Any], Any]
    put: Callable[[Any, Any], None]
    exportable: Mapping[str, frozenset[Any]]
    replacement: Mapping[str, Any]

    def exports(self, value: Any, exporter: str) -> bool:
        """Whether ``exporter`` can export the module with ``value``."""
        values = value.values() if isinstance(value, dict) else [value]
        return all(v is None or v in self.exportable[exporter] for v in values)


def _has_experts_implementation(module: Any) -> bool:
    can_set = getattr(module, "_can_set_experts_implementation", None)
    return (
        callable(can_set)
        and hasattr(module, "get_experts_implementation")
        and hasattr(module, "set_experts_implementation")
        and bool(can_set())
    )


def _has_use_cache(module: Any) -> bool:
    """A Hugging Face model whose forward returns its KV cache by default (``config.use_cache``)."""
    config = getattr(module, "config", None)
    return (
        config is not None
        and isinstance(getattr(config, "use_cache", None), bool)
        and callable(getattr(module, "forward", None))
        and "use_cache" in _forward_parameters(module)
    )


def _forward_parameters(module: Any) -> frozenset[str]:
    import inspect

    try:
        return frozenset(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _set_use_cache(module: Any, value: bool) -> None:
    module.config.use_cache = value


#: The known non-exportable settings. Hugging Face MoE models: the dynamo exporter
#: exports ``"grouped_mm"`` (the default, through :func:`grouped_mm`) and ``"batched_mm"``;
#: the TorchScript exporter only ``"batched_mm"`` (it has no grouped matmul); none
#: exports ``"eager"`` (a data-dependent loop over the experts hit) or the GPU kernels
#: (``"deepgemm"``, ``"sonicmoe"``).
EXPORTABLE_SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="experts_implementation",
        applies=_has_experts_implementation,
        get=lambda m: m.get_experts_implementation(),
        put=lambda m, v: m.set_experts_implementation(v),
        exportable={
            "dynamo": frozenset({"grouped_mm", "batched_mm"}),
            "torchscript": frozenset({"batched_mm"}),
        },
        replacement={"dynamo": "grouped_mm", "torchscript": "batched_mm"},
    ),
    # A causal LM's default forward returns a DynamicCache (no exporter returns one): a
    # plain forward exports without it (from_causal_lm exports the cache as graph values).
    Setting(
        name="use_cache",
        applies=_has_use_cache,
        get=lambda m: m.config.use_cache,
        put=_set_use_cache,
        exportable={"dynamo": frozenset({False}), "torchscript": frozenset({False})},
        replacement={"dynamo": False, "torchscript": False},
    ),
)


@contextlib.contextmanager
def exportable_settings(
    module: Any, exporter: str = "dynamo", *, skip: frozenset[str] = frozenset()
) -> Iterator[list[str]]:
    """Give ``module`` (and its submodules) settings ``exporter`` can export inside the block.

    Yields one line per changed setting (``"<module path>: <setting> <old> -> <new>"``);
    each change is logged once. On exit every changed setting gets its old value
    back, in reverse order, whether or not the block raised. Settings named in ``skip``
    are left as they are (an exporter front-end that handles them itself).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> with exportable_settings(net) as changed:
        ...     len(changed)
        0
    """
    changed: list[str] = []
    undo: list[tuple[Setting, Any, Any]] = []
    handled: set[tuple[int, int]] = set()
    try:
        for path, sub in module.named_modules():
            for setting in EXPORTABLE_SETTINGS:
                if setting.name in skip:
                    continue
                key = id(setting), id(getattr(sub, "config", sub))
                if key in handled or not setting.applies(sub):
                    continue
                handled.add(key)
                old = setting.get(sub)
                new = setting.replacement[exporter]
                if setting.exports(old, exporter):
                    continue
                try:
                    setting.put(sub, new)
                except Exception as err:  # the library refuses the switch: export as configured
                    log.warning(
                        "cannot switch %s's %s from %r to %r for the export (%s); exporting as configured",
                        path or type(module).__name__,
                        setting.name,
                        old,
                        new,
                        err,
                    )
                    continue
                undo.append((setting, sub, old))
                line = f"{path or type(module).__name__}: {setting.name} {old!r} -> {new!r}"
                changed.append(line)
                log.warning(
                    "exporting %s with %s=%r (the %s exporter cannot export %r); restored afterwards",
                    path or type(module).__name__,
                    setting.name,
                    new,
                    exporter,
                    old,
                )
        yield changed
    finally:
        for setting, sub, old in reversed(undo):
            setting.put(sub, old)
