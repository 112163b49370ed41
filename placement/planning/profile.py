"""The profiler: per-op cost (measured time, bytes, FLOPs) and liveness-based memory.

For every op (copies excluded) :func:`profile` records

* ``time_s``: the median forward time over ``repeats`` runs, measured by ONNX
  Runtime's own profiler (``SessionOptions.enable_profiling``) on one plain CPU
  session of the whole model with graph optimisations off (so every ONNX node is
  timed under its own name) and one intra-op thread (stable, proportional timings);
* ``output_bytes``: bytes of the blobs it produces every step (static shapes from the
  exporter); a load-time value (made from parameters and constants alone, such as an
  exporter's weight transpose) is parameter memory, as :class:`GraphInfo` counts it, not output;
* ``param_bytes``: bytes of the parameters (initializers) it is the *first* consumer
  of, so that the per-op values add up to the model's parameter bytes;
* ``flops``: an analytic count from the per-op-type rule table
  (:data:`placement.analysis.costs.FLOP_RULES`) with a default rule (one FLOP per output element).

Results are cached on the model (``model.ir_model.meta``), keyed by a fingerprint of
the graph's structure (op names, types and outputs; copies and devices ignored) and
the input shapes, so placing ops or injecting copies keeps the cache valid.

Peak activation memory is liveness based: see :mod:`placement.planning.graph_info`.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> prof = pl.profile(model, repeats=2)
    >>> len(prof.ops) == len(model.ops), prof.backend
    (True, 'ort')
    >>> prof.total_output_bytes > 0
    True
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from placement.analysis import costs
from placement.errors import InputError, PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.nodes import is_copy_node, node_device
from placement.planning.dims import caller, planned_dims
from placement.planning.graph_info import GraphInfo, peak_activation_bytes

__all__ = [
    "OpProfile",
    "Profile",
    "Shapes",
    "add_estimates",
    "cached_profile",
    "make_sample_inputs",
    "op_flops",
    "profile",
    "symbol_bindings",
]

log = logging.getLogger(__name__)


_CACHE_KEY = "placement.profile"


COST_KINDS = ("time", "size", "flops")


def add_estimates(model: Model | ir.Model, report: Any, *, dims: Mapping[str, int] | None = None) -> None:
    """Fill ``peak_activation_bytes`` and ``time_s`` of each row of a ``report.summary.Summary``.

    Times come from the latest cached profile with times of the model's structure;
    without one ``time_s`` stays None.
    """
    wrapped = model if isinstance(model, Model) else Model(model)
    peaks = peak_activation_bytes(wrapped, dims=dims)
    prof = cached_profile(wrapped, need_time=True)
    times: dict[Device, float] = {}
    if prof is not None:
        for node in wrapped.graph:
            op = prof.ops.get(node.name or "")
            if op is not None and op.time_s is not None and not is_copy_node(node):
                device = node_device(node)
                times[device] = times.get(device, 0.0) + op.time_s
    for row in report.rows:
        row.peak_activation_bytes = peaks.get(row.device, 0)
        row.time_s = times.get(row.device, 0.0) if prof is not None else None


class Shapes:
    """Static dims of values: the IR's own shapes, with symbolic dims read from ``bindings``
    (symbol -> size: a dynamic batch of the sample inputs), else ``extra`` (from shape
    inference).

    Example:
        >>> import onnx_ir as ir
        >>> x = ir.Value(name="x", shape=ir.Shape(["batch", 16]))
        >>> Shapes().dims(x), Shapes(bindings={"batch": 4}).dims(x)
        (None, [4, 16])
    """

    def __init__(
        self, extra: Mapping[str, list[int]] | None = None, *, bindings: Mapping[str, int] | None = None
    ) -> None:
        self.extra = dict(extra or {})
        self.bindings = dict(bindings or {})

    def dims(self, value: ir.Value | None) -> list[int] | None:
        if value is None:
            return None
        shape = value.shape
        if shape is not None:
            if all(isinstance(d, int) for d in shape):
                return [int(d) for d in shape]
            if self.bindings:
                bound = [d if isinstance(d, int) else self.bindings.get(str(d.value)) for d in shape]
                if all(d is not None for d in bound):
                    return [int(d) for d in bound]  # type: ignore[arg-type]
        return self.extra.get(value.name or "")

    def numel(self, value: ir.Value | None) -> int:
        dims = self.dims(value)
        return math.prod(dims) if dims is not None else 0

    def out_numel(self, node: ir.Node) -> int:
        return sum(self.numel(v) for v in node.outputs)


def symbol_bindings(model: Model, inputs: Mapping[str, np.ndarray] | None) -> dict[str, int]:
    """Symbolic input dims -> sizes: from ``inputs`` (name -> array), and 1 for any symbol
    they do not give (no inputs: every symbol), so FLOPs of a model exported with a dynamic
    batch count as for that batch (or one example) instead of as nothing.

    Example:
        >>> import numpy as np, torch
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        >>> symbol_bindings(model, {"input": np.zeros((6, 16), np.float32)}), symbol_bindings(model, None)
        ({'batch': 6}, {'batch': 1})
    """
    bindings: dict[str, int] = {}
    for value in model.graph.inputs:
        if value.shape is None:
            continue
        array = (inputs or {}).get(value.name or "")
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int) or dim.value is None:
                continue
            size = int(array.shape[axis]) if array is not None and axis < array.ndim else 1
            bindings.setdefault(str(dim.value), size)
    return bindings


def op_flops(node: ir.Node, shapes: Shapes | None = None) -> int:
    """Analytic FLOPs of one op from :data:`placement.analysis.costs.FLOP_RULES`
    (default: one per output element)."""
    return costs.op_flops(node, shapes or Shapes())


@dataclass(frozen=True)
class OpProfile:
    """Cost figures of one op.

    Attributes:
        name: op name.
        op_type: ONNX op type.
        time_s: median measured forward time in seconds (None if not measured).
        output_bytes: bytes of the blobs it produces every step (load-time values count 0).
        param_bytes: bytes of the parameters it is the first reader of.
        flops: analytic FLOPs.
    """

    name: str
    op_type: str
    time_s: float | None
    output_bytes: int
    param_bytes: int
    flops: int


@dataclass
class Profile:
    """Per-op costs of a model, in graph order (copies excluded).

    Attributes:
        ops: op name -> :class:`OpProfile`, in graph order.
        backend: ``"ort"`` when times were measured, ``"static"`` otherwise.
        repeats: timed runs per op.
        fingerprint: structure fingerprint of the profiled model.
    """

    ops: dict[str, OpProfile]
    backend: str
    repeats: int
    fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def has_time(self) -> bool:
        """True if forward times were measured."""
        return all(p.time_s is not None for p in self.ops.values())

    @property
    def total_time_s(self) -> float | None:
        """Sum of per-op times (None if not measured)."""
        if not self.has_time:
            return None
        return float(sum(p.time_s or 0.0 for p in self.ops.values()))

    @property
    def total_output_bytes(self) -> int:
        """Sum of per-op output bytes."""
        return sum(p.output_bytes for p in self.ops.values())

    def costs(self, kind: str = "time") -> list[int]:
        """Integer per-op costs in graph order: ns (``"time"``), bytes (``"size"``) or FLOPs.

        Raises:
            PlanError: unknown kind, or ``"time"`` on a profile without times.
        """
        if kind == "time":
            if not self.has_time:
                raise PlanError("this profile has no measured times; profile with time=True")
            return [max(0, round((p.time_s or 0.0) * 1e9)) for p in self.ops.values()]
        if kind == "size":
            return [p.param_bytes + p.output_bytes for p in self.ops.values()]
        if kind == "flops":
            return [p.flops for p in self.ops.values()]
        raise PlanError(f"unknown cost {kind!r}; expected one of {', '.join(COST_KINDS)}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "backend": self.backend,
            "repeats": self.repeats,
            "fingerprint": self.fingerprint,
            "ops": [vars(p) for p in self.ops.values()],
        }


def fingerprint(model: Model) -> str:
    """A hash of the model's structure (op names, types, outputs; copies and devices ignored)."""
    h = hashlib.sha1()
    for value in model.graph.inputs:
        h.update(f"in:{value.name}:{value.shape}:{value.dtype};".encode())
    for node in model.graph:
        if is_copy_node(node):
            continue
        h.update(f"{node.name}:{node.op_type}:{','.join(v.name or '' for v in node.outputs)};".encode())
    return h.hexdigest()[:16]


def _cache(model: Model) -> dict[str, Profile]:
    meta = model.ir_model.meta
    cache = meta.get(_CACHE_KEY)
    if not isinstance(cache, dict):
        cache = {}
        meta[_CACHE_KEY] = cache
    return cache


def cached_profile(model: Model, *, need_time: bool = False) -> Profile | None:
    """The most recent cached profile of this model's current structure, if any."""
    fp = fingerprint(model)
    best = None
    for prof in _cache(model).values():
        if prof.fingerprint == fp and (prof.has_time or not need_time):
            if best is None or (prof.has_time and not best.has_time):
                best = prof
    return best


def make_sample_inputs(
    model: Model, *, seed: int = 0, dims: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Inputs of the graph's shapes: normal floats, zeros for ints and bools.

    Zeros are valid token ids and indices for any vocabulary, which random ints
    might not be. Symbolic dimensions take their size in ``dims`` (default:
    :func:`placement.planning.dims.planned_dims`, 1 unless a plan stored another).

    Raises:
        InputError: an input has no known shape or dtype (pass sample inputs; the
            message names the function called).

    Example:
        >>> import torch
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> net, (x,) = mlp.build("tiny")
        >>> model = pl.from_torch(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
        >>> make_sample_inputs(model, dims={"batch": 3})["input"].shape
        (3, 16)
    """
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    inits = model.graph.initializers
    bound = Shapes(bindings=planned_dims(model) if dims is None else dims)
    for value in model.graph.inputs:
        if value.name in inits:
            continue
        shape = bound.dims(value)
        if shape is None or value.dtype is None:
            what = "no known shape" if shape is None else "no known dtype"
            raise InputError(
                f"graph input {value.name!r} has {what} (shape {value.shape}, dtype {value.dtype}): "
                f"pass sample_inputs= to {caller()} (--input NAME=FILE.npy on the command line)"
            )
        dims_ = shape
        dtype = value.dtype.numpy()
        if np.issubdtype(dtype, np.floating):
            inputs[value.name or ""] = rng.standard_normal(dims_).astype(dtype)
        else:
            inputs[value.name or ""] = np.zeros(dims_, dtype=dtype)
    return inputs


def _normalise_inputs(model: Model, sample_inputs: Any) -> dict[str, np.ndarray]:
    names = model.inputs
    if isinstance(sample_inputs, Mapping):
        unknown = [k for k in sample_inputs if k not in names]
        if unknown:
            raise InputError(f"unknown input {unknown[0]!r}; the model's inputs are {names}")
        missing = [k for k in names if k not in sample_inputs]
        if missing:
            raise InputError(f"missing input {missing[0]!r}; the model's inputs are {names}")
        items = [(k, sample_inputs[k]) for k in names]
    else:
        seq = list(sample_inputs) if isinstance(sample_inputs, (list, tuple)) else [sample_inputs]
        if len(seq) != len(names):
            raise InputError(f"got {len(seq)} sample inputs; the model has {len(names)}: {names}")
        items = list(zip(names, seq))
    result = {}
    for name, array in items:
        if hasattr(array, "detach"):
            array = array.detach().cpu().numpy()
        result[name] = np.asarray(array)
    return result


def _time_with_ort(
    model: Model, inputs: dict[str, np.ndarray], *, repeats: int, warmup: int, optimized: bool = False
) -> dict[str, float]:
    """Per-op kernel times from ONNX Runtime's profiler, one CPU session for the whole model.

    With ``optimized`` the session runs with ONNX Runtime's graph optimisations on (as
    the runtime's stage sessions do) and each optimised node's time is given to the op
    it came from (:func:`_attribute_to_ops`); otherwise optimisations are off and every
    op is timed by its own name.

    The session is built as stage sessions are (:func:`placement.graph.session.ort_session`):
    its weights bypass the protobuf, so models over 2 GB are timed too; their weights are read
    from the model's own (possibly memory-mapped) arrays.

    Raises:
        PlanError: ONNX Runtime cannot build or run the model (the message says which).
    """
    import onnxruntime as ort

    from placement.graph.session import ort_session

    tmp = tempfile.mkdtemp(prefix="placement-profile-")
    stage = "build a session of"
    try:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "ort")
        level = ort.GraphOptimizationLevel
        options.graph_optimization_level = level.ORT_ENABLE_ALL if optimized else level.ORT_DISABLE_ALL
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        session = ort_session(model, options, ["CPUExecutionProvider"])
        stage = "run"
        for _ in range(warmup + repeats):
            session.run(None, inputs)
        path = session.end_profiling()
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
    except PlanError:
        raise
    except Exception as err:  # ORT raises several types (Fail, InvalidArgument, RuntimeException)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlanError(
            f"profiling failed: ONNX Runtime could not {stage} the model ({first}); "
            "pass sample_inputs that the model accepts, or plan with cost='flops' or 'size'"
        ) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    samples: dict[str, list[float]] = {}
    suffix = "_kernel_time"
    for event in events:
        if event.get("cat") != "Node":
            continue
        name = str(event.get("name", ""))
        if name.endswith(suffix):
            samples.setdefault(name[: -len(suffix)], []).append(float(event.get("dur", 0)) * 1e-6)
    times = {name: statistics.median(vals[warmup:] or vals) for name, vals in samples.items()}
    return _attribute_to_ops(model, times) if optimized else times


def _attribute_to_ops(model: Model, node_times: Mapping[str, float]) -> dict[str, float]:
    """Per-op times from an optimised session's per-node times.

    ONNX Runtime names an optimised node after what it replaced: the op's own name
    (kept), ``<op>/<Fusion>`` for a fusion led by ``<op>`` (``node_MatMul_7/MatMulAddFusion``),
    or ``<value>_nchwc`` for a node converted to the blocked layout, which computes
    ``<value>``. Such a node's time goes to that op; ops fused into another get 0 (their
    work is in the fused node's time). Helper nodes (layout reorders, reshapes around a
    Gemm) match nothing: their time is spread over the matched ops in proportion, so
    the total stays the session's.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> nodes = {"node_linear/FusedGemm": 2.0, "relu_nchwc": 1.0, "reorder": 0.3}
        >>> times = _attribute_to_ops(model, nodes)
        >>> round(times["node_linear"], 6), round(times["node_relu"], 6)
        (2.2, 1.1)
    """
    names = {node.name for node in model.graph}
    producer = {out.name: node.name for node in model.graph for out in node.outputs}
    times: dict[str, float] = {}
    unmatched = 0.0
    for node_name, seconds in node_times.items():
        op = node_name if node_name in names else None
        if op is None and "/" in node_name and node_name.split("/", 1)[0] in names:
            op = node_name.split("/", 1)[0]
        if op is None and node_name.endswith("_nchwc"):
            op = producer.get(node_name[: -len("_nchwc")])
        if op is None:
            unmatched += seconds
        else:
            times[op] = times.get(op, 0.0) + seconds
    matched = sum(times.values())
    if unmatched and matched > 0:
        scale = (matched + unmatched) / matched
        times = {op: t * scale for op, t in times.items()}
    return times


def profile(
    model: Model,
    *,
    sample_inputs: Any = None,
    time: bool = True,
    repeats: int = 5,
    warmup: int = 1,
    refresh: bool = False,
    optimized: bool = False,
    dims: Mapping[str, int] | None = None,
) -> Profile:
    """Profile every op of ``model`` (copies excluded); cache the result on the model.

    Args:
        model: the model (its placement does not matter).
        sample_inputs: a dict name -> array, a sequence in graph-input order, or one
            array (numpy or torch). ``None``: :func:`make_sample_inputs` (normal floats,
            zero ints, so token ids are valid). Their sizes also count the FLOPs of
            values with symbolic dims (:func:`symbol_bindings`; without them every
            symbol counts as 1).
        time: measure forward times with ONNX Runtime; ``False`` gives bytes and FLOPs only.
        repeats: timed runs (the median is kept); ``warmup`` untimed runs come first.
        refresh: ignore the cache.
        optimized: time a session with ONNX Runtime's graph optimisations on and give
            each fused or re-laid-out node's time to the op it came from (ops fused
            into another cost 0). This is what the ONNX Runtime executor's stage
            sessions run, so a plan balanced on it is balanced for ONNX Runtime
            (``auto_place(runtime="ort")``, its default, profiles this way); the
            default here (optimisations off, every op timed alone) matches op-by-op
            runtimes such as torch eager and the ``pl.to_torch`` lowering
            (``auto_place(runtime="torch")``).
        dims: sizes of symbolic dimensions the sample inputs do not give (``{"batch": 8}``;
            default :func:`placement.planning.dims.planned_dims`): made-up inputs and
            FLOPs count at them.

    Returns:
        A :class:`Profile`; :attr:`Profile.costs` gives integer cost vectors.

    Raises:
        InputError: bad sample inputs.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> prof = pl.profile(model, time=False)
        >>> [p.op_type for p in prof.ops.values()]
        ['Gemm', 'Relu', 'Gemm', 'Relu', 'Gemm']
        >>> pl.profile(model, time=False) is prof  # cached on the model
        True
    """
    if repeats < 1:
        raise PlanError(f"repeats must be >= 1, got {repeats}")
    fp = fingerprint(model)
    inputs = None
    if time:
        inputs = (
            make_sample_inputs(model, dims=dims)
            if sample_inputs is None
            else _normalise_inputs(model, sample_inputs)
        )
        signature = ",".join(f"{k}:{v.dtype}{list(v.shape)}" for k, v in inputs.items())
        key = f"{fp}|ort{'-optimized' if optimized else ''}|{signature}"
    else:
        inputs = None if sample_inputs is None else _normalise_inputs(model, sample_inputs)
        bound = planned_dims(model, sample_inputs=inputs, batch=dims)
        key = f"{fp}|static" + (f"|{sorted(bound.items())}" if bound else "")
    cache = _cache(model)
    if not refresh:
        hit = cache.get(key)
        if hit is not None:
            return hit
        if not time:
            timed = cached_profile(model, need_time=True)
            if timed is not None:
                return timed
    info = GraphInfo(model, dims=planned_dims(model, sample_inputs=inputs, batch=dims))
    times: dict[str, float] = {}
    if time:
        assert inputs is not None
        times = _time_with_ort(model, inputs, repeats=repeats, warmup=warmup, optimized=optimized)
    first_reader: dict[int, int] = {}
    for pos, params in enumerate(info.op_params):
        for k in params:
            first_reader.setdefault(k, pos)
    owned = [0] * len(info)
    for k, pos in first_reader.items():
        owned[pos] += info.param_bytes[k]
    shapes = Shapes(bindings=planned_dims(model, sample_inputs=inputs, batch=dims))
    ops: dict[str, OpProfile] = {}
    for pos, node in enumerate(info.nodes):
        name = info.names[pos]
        ops[name] = OpProfile(
            name=name,
            op_type=node.op_type,
            time_s=times.get(name, 0.0) if time else None,
            output_bytes=sum(info.step_bytes[b] for b in info.op_outputs[pos]),
            param_bytes=owned[pos],
            flops=op_flops(node, shapes),
        )
    result = Profile(
        ops=ops, backend="ort" if time else "static", repeats=repeats if time else 0, fingerprint=fp
    )
    cache[key] = result
    if time:
        log.info("profiled %d ops: %.3f ms per forward", len(ops), (result.total_time_s or 0) * 1e3)
    return result
