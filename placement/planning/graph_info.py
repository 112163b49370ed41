"""The planner's graph tables: ops in graph order, blobs, parameters, and liveness-based memory.

:class:`GraphInfo` numbers the ops of a model (copies excluded) and its blobs and
parameters once, so the planner asks for a segment's parameter bytes, peak activations
or incoming copies by position. Every blob has a *first* position
(:attr:`GraphInfo.blob_first`): the op that makes it, or, for a graph input, the op that
first reads it (it is fed there); "made before ``i``" always means ``blob_first < i``.

Peak activation memory is liveness based (:func:`peak_activation_bytes`): a device
holds a blob from the moment it is produced there (or, for a blob that arrives by
copy or is a graph input, from the start of the stage that first reads it) until
its last use there; a blob that leaves the device, or is a graph output, stays until
the end of the stage that produced it (stages are the maximal same-device runs of
ops in graph order, the unit the runtimes execute). Parameters are counted apart.

Load-time values (:func:`placement.analysis.dependence.load_time_values`: what ops make
from parameters and constants alone, such as the ``Transpose`` of a weight an exporter
puts before a ``MatMul``, or a ``Constant``) are weight preprocessing, not per-batch
activations: ONNX Runtime folds them into constants when it creates a session, and the
torch lowering absorbs a weight's transpose into its linear. They count as parameter
memory of the device whose per-step ops read them, and the ops that make them hold
nothing (:meth:`GraphInfo.segment_param_bytes`, :meth:`GraphInfo.part_param_bytes`):
such a device holds the parameters its ops read, plus, for the load-time values they read
(grouped by the parameters they are made from), the larger of those values (what ONNX
Runtime keeps once it has folded them) and their parameters (what the torch lowering
keeps). So a transposed weight counts once, as its weight, where it is used; a slice of
a buffer counts as the whole buffer; a tied weight read directly and through its
transpose on one device counts twice, as ONNX Runtime holds it. Activation peaks and
per-step copies leave load-time values out.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> info = GraphInfo(pl.from_torch(*mlp.build("tiny")))
    >>> len(info), info.segment_in_bytes(0, len(info))
    (5, 0)
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import onnx_ir as ir

from placement.analysis.dependence import copy_origin, load_time_values
from placement.analysis.shapes import infer_shapes
from placement.errors import PlanError
from placement.graph.causal_lm import kv_layers
from placement.graph.device import Device
from placement.graph.model import Model, value_nbytes
from placement.graph.nodes import is_copy_node, node_device
from placement.planning.dims import planned_dims

__all__ = ["GraphInfo", "add_kv_cache", "peak_activation_bytes"]

log = logging.getLogger(__name__)


class GraphInfo:
    """Integer tables of a model's non-copy ops, in graph (topological) order.

    Copies are looked through: a consumer of a copy's output counts as a consumer of
    the copied blob. Blobs are activations (outputs of ops, and graph inputs);
    parameters are initializers.

    Attributes:
        nodes: the ``onnx_ir.Node`` of each position.
        names: op names by position.
        op_inputs: per position, the distinct activation blob ids it reads.
        op_params: per position, the distinct parameter ids it reads.
        op_outputs: per position, the blob ids it produces.
        blob_bytes, blob_producer (-1 for graph inputs), blob_consumers (sorted
        positions), blob_is_output: per blob id.
        param_bytes, param_names: per parameter id.
        blob_fixed: per blob, whether it is a load-time value (made from parameters and
            constants alone); step_bytes: its bytes per step (0 for load-time values).
        op_fixed: per position, whether the op only makes load-time values (weight
            preprocessing, folded into its readers).
        held_params, held_fixed: per position, the parameters and the load-time blobs an
            op that runs every step reads (both empty for ``op_fixed`` ops).
        blob_sources, blob_group: per load-time blob, the parameters it is made from, and
            its group (load-time values made from shared parameters share one).
    """

    def __init__(self, model: Model, *, dims: Mapping[str, int] | None = None) -> None:
        graph = model.graph
        #: the sizes symbolic dimensions count at (:func:`placement.planning.dims.planned_dims`)
        self.dims: dict[str, int] = dict(dims) if dims is not None else planned_dims(model)
        self.nodes: list[ir.Node] = [n for n in graph if not is_copy_node(n)]
        self.names: list[str] = [n.name or "" for n in self.nodes]
        self.position: dict[str, int] = {name: i for i, name in enumerate(self.names)}
        inits = graph.initializers
        self.param_names: list[str] = list(inits)
        param_id = {id(v): k for k, v in enumerate(inits.values())}
        self.param_bytes: list[int] = [int(math.ceil(value_nbytes(v) or 0)) for v in inits.values()]
        self.blob_names: list[str] = []
        self.blob_bytes: list[int] = []
        self.blob_producer: list[int] = []
        self.blob_consumers: list[list[int]] = []
        self.blob_is_output: list[bool] = []
        blob_id: dict[int, int] = {}
        self.unknown_size: list[str] = []
        self.state_bytes: list[int] = []  # per position: bytes held across steps (``add_state``)
        self._state_prefix: list[int] | None = None
        self.blob_values: list[ir.Value] = []

        def new_blob(value: ir.Value, producer: int) -> int:
            b = len(self.blob_names)
            blob_id[id(value)] = b
            self.blob_values.append(value)
            self.blob_names.append(value.name or "")
            size = value_nbytes(value, self.dims)
            if size is None:
                self.unknown_size.append(value.name or "")
            self.blob_bytes.append(int(math.ceil(size)) if size else 0)
            self.blob_producer.append(producer)
            self.blob_consumers.append([])
            self.blob_is_output.append(False)
            return b

        for value in graph.inputs:
            if id(value) not in param_id:
                new_blob(value, -1)
        #: per position: does the op depend (transitively) on a graph input?
        self.data_dependent: list[bool] = []
        self.op_inputs: list[list[int]] = []
        self.op_params: list[list[int]] = []
        self.op_outputs: list[list[int]] = []
        for i, node in enumerate(self.nodes):
            acts: list[int] = []
            params: list[int] = []
            for value in node.inputs:
                if value is None:
                    continue
                value = copy_origin(value)
                k = param_id.get(id(value))
                if k is not None:
                    if k not in params:
                        params.append(k)
                    continue
                b = blob_id.get(id(value))
                if b is None:  # produced outside the graph order (should not happen)
                    b = new_blob(value, -1)
                if b not in acts:
                    acts.append(b)
                    self.blob_consumers[b].append(i)
            self.op_inputs.append(acts)
            self.op_params.append(params)
            self.op_outputs.append([new_blob(v, i) for v in node.outputs])
            self.data_dependent.append(
                any(self.blob_producer[b] < 0 or self.data_dependent[self.blob_producer[b]] for b in acts)
            )
        for value in graph.outputs:
            b = blob_id.get(id(copy_origin(value)))
            if b is not None:
                self.blob_is_output[b] = True
        #: per blob: the position that makes it, or first reads it if it is fed (a graph
        #: input: fed where first used); ``len(nodes)`` for a graph input nothing reads.
        self.blob_first: list[int] = [
            producer if producer >= 0 else (consumers[0] if consumers else len(self.nodes))
            for producer, consumers in zip(self.blob_producer, self.blob_consumers)
        ]
        if self.unknown_size and infer_shapes(model):  # annotate what the exporter left unshaped
            self._size_unshaped()
        fixed = {id(v) for v in load_time_values(graph)}
        self.blob_fixed: list[bool] = [id(value) in fixed for value in self.blob_values]
        self.step_bytes: list[int] = [
            0 if is_fixed else size for size, is_fixed in zip(self.blob_bytes, self.blob_fixed)
        ]
        self.op_fixed: list[bool] = [
            bool(outs) and all(self.blob_fixed[b] for b in outs) for outs in self.op_outputs
        ]
        self._fold_load_time_values()
        if self.unknown_size:
            log.info(
                "%d blobs have no static shape and count as 0 bytes (first: %r)",
                len(self.unknown_size),
                self.unknown_size[0],
            )

    def _size_unshaped(self) -> None:
        """Size again the blobs that had no static shape, after shape inference annotated them."""
        self.unknown_size = []
        for b, value in enumerate(self.blob_values):
            if self.blob_bytes[b]:
                continue
            size = value_nbytes(value, self.dims)
            if size is None:
                self.unknown_size.append(value.name or "")
            else:
                self.blob_bytes[b] = int(math.ceil(size))

    def _fold_load_time_values(self) -> None:
        """``held_params``, ``held_fixed`` and ``blob_sources``: what each per-step op holds
        (see the module docstring)."""
        self.blob_sources: list[list[int]] = [[] for _ in self.blob_bytes]
        self.held_params: list[list[int]] = []
        self.held_fixed: list[list[int]] = []
        for pos, (params, acts) in enumerate(zip(self.op_params, self.op_inputs)):
            if self.op_fixed[pos]:
                made_from = list(params)
                for b in acts:
                    made_from += [k for k in self.blob_sources[b] if k not in made_from]
                for b in self.op_outputs[pos]:
                    self.blob_sources[b] = made_from
                self.held_params.append([])
                self.held_fixed.append([])
            else:
                self.held_params.append(params)
                self.held_fixed.append([b for b in acts if self.blob_fixed[b]])
        # load-time values made from shared parameters are compared with them as one group
        root = list(range(len(self.param_bytes)))

        def find(k: int) -> int:
            while root[k] != k:
                root[k] = root[root[k]]
                k = root[k]
            return k

        for made_from in self.blob_sources:
            for k in made_from[1:]:
                root[find(k)] = find(made_from[0])
        self.blob_group: list[int] = [
            find(made_from[0]) if made_from else -1 - b for b, made_from in enumerate(self.blob_sources)
        ]

    def _held_bytes(self, positions: Iterable[int]) -> int:
        """Parameter memory of a device running the ops at ``positions`` (module docstring):
        the parameters they read, plus, per group of load-time values made from the same
        parameters, the larger of the values they read and those parameters (not read
        directly)."""
        direct: set[int] = set()
        fixed: set[int] = set()
        held_params, held_fixed = self.held_params, self.held_fixed
        for pos in positions:
            direct.update(held_params[pos])
            if held_fixed[pos]:
                fixed.update(held_fixed[pos])
        held = sum(map(self.param_bytes.__getitem__, direct))
        if not fixed:
            return held
        folded: dict[int, int] = {}
        sources: dict[int, set[int]] = {}
        for b in fixed:
            group = self.blob_group[b]
            folded[group] = folded.get(group, 0) + self.blob_bytes[b]
            sources.setdefault(group, set()).update(self.blob_sources[b])
        for group, size in folded.items():
            held += max(size, sum(self.param_bytes[k] for k in sources[group] - direct))
        return held

    def __len__(self) -> int:
        return len(self.nodes)

    # -- memory of one contiguous segment -------------------------------------------

    def segment_param_bytes(self, i: int, j: int) -> int:
        """Parameter bytes of a device that runs ops ``i..j-1`` (shared parameters count once;
        load-time values as the module docstring says)."""
        return self._held_bytes(range(i, j))

    def segment_peak_activation(self, i: int, j: int) -> int:
        """Peak live activation bytes of a device that runs exactly ops ``i..j-1`` (load-time
        values left out)."""
        if j <= i:
            return 0
        diff = [0] * (j - i + 1)
        received: set[int] = set()
        for pos in range(i, j):
            for b in self.op_inputs[pos]:
                if self.blob_producer[b] < i and b not in received:
                    received.add(b)
                    size = self.step_bytes[b]
                    if size:
                        end = _last_before(self.blob_consumers[b], j)
                        diff[0] += size
                        diff[end - i + 1] -= size
            for b in self.op_outputs[pos]:
                size = self.step_bytes[b]
                if not size:
                    continue
                consumers = self.blob_consumers[b]
                if self.blob_is_output[b] or (consumers and consumers[-1] >= j):
                    end = j - 1
                elif consumers:
                    end = consumers[-1]
                else:
                    end = pos
                diff[pos - i] += size
                diff[end - i + 1] -= size
        return _max_prefix(diff)

    def segment_memory(self, i: int, j: int) -> int:
        """Parameters, state (KV caches) plus peak activations of a device that runs ops ``i..j-1``."""
        held = self.segment_param_bytes(i, j) + self.segment_state_bytes(i, j)
        return held + self.segment_peak_activation(i, j)

    # -- state held by ops (KV caches) ------------------------------------------------

    def add_state(self, position: int, nbytes: int) -> None:
        """Memory that the op at ``position`` holds across steps (a layer's KV cache at the
        planned batch and length): counted on its device like its parameters."""
        if not self.state_bytes:
            self.state_bytes = [0] * len(self.nodes)
        self.state_bytes[position] += int(nbytes)
        self._state_prefix = None

    def segment_state_bytes(self, i: int, j: int) -> int:
        """State bytes (see :meth:`add_state`) of the ops ``i..j-1``."""
        if not self.state_bytes or j <= i:
            return 0
        prefix = self._state_prefix
        if prefix is None:
            prefix = self._state_prefix = [0, *itertools.accumulate(self.state_bytes)]
        return prefix[j] - prefix[i]

    def part_state_bytes(self, part: Sequence[int], num_parts: int) -> list[int]:
        """State bytes per part of an arbitrary placement (``part[pos]`` = its part)."""
        totals = [0] * num_parts
        for pos, nbytes in enumerate(self.state_bytes):
            if nbytes:
                totals[part[pos]] += nbytes
        return totals

    def blobs_into(self, i: int, j: int) -> list[int]:
        """Distinct activations read by ops ``i..j-1`` and made (or first fed) before ``i``."""
        seen: set[int] = set()
        found = []
        for pos in range(i, j):
            for b in self.op_inputs[pos]:
                if b not in seen and self.blob_first[b] < i:
                    seen.add(b)
                    found.append(b)
        return found

    def segment_in_bytes(self, i: int, j: int) -> int:
        """Bytes copied into a device running ops ``i..j-1`` from earlier ones (per step).

        Counts each distinct activation read there and produced before ``i``; a graph
        input counts when its first reader lies before ``i`` (it is fed where first used);
        load-time values (computed from parameters alone) count 0.
        """
        return sum(self.step_bytes[b] for b in self.blobs_into(i, j))

    def cut_bytes(self, c: int) -> int:
        """Bytes of the distinct blobs made (or fed) before position ``c`` and read at or after it."""
        return sum(
            self.step_bytes[b]
            for b, consumers in enumerate(self.blob_consumers)
            if consumers and consumers[-1] >= c and self.blob_first[b] < c
        )

    # -- memory of an arbitrary placement --------------------------------------------

    def peak_activations(
        self, part: Sequence[int], num_parts: int, *, per_step: Collection[int] = ()
    ) -> list[int]:
        """Peak live activation bytes per part for an arbitrary assignment ``part[pos]`` (load-time
        values left out, except the blob ids in ``per_step``: made every step after all, say
        from a weight streamed in every step)."""
        n = len(self.nodes)
        run_start = [0] * n
        run_end = [0] * n
        for pos in range(n):
            run_start[pos] = run_start[pos - 1] if pos and part[pos - 1] == part[pos] else pos
        for pos in range(n - 1, -1, -1):
            run_end[pos] = run_end[pos + 1] if pos < n - 1 and part[pos + 1] == part[pos] else pos
        diffs = [[0] * (n + 1) for _ in range(num_parts)]
        for b, size in enumerate(self.step_bytes):
            if b in per_step:
                size = self.blob_bytes[b]
            if not size:
                continue
            producer = self.blob_producer[b]
            by_part: dict[int, list[int]] = {}
            for c in self.blob_consumers[b]:
                by_part.setdefault(part[c], []).append(c)
            home = part[producer] if producer >= 0 else None
            if home is not None:
                own = by_part.get(home)
                end = own[-1] if own else producer
                if self.blob_is_output[b] or len(by_part) > (1 if own else 0):
                    end = max(end, run_end[producer])
                diffs[home][producer] += size
                diffs[home][end + 1] -= size
            for p, positions in by_part.items():
                if p == home:
                    continue
                diffs[p][run_start[positions[0]]] += size
                diffs[p][positions[-1] + 1] -= size
        return [_max_prefix(d) for d in diffs]

    def part_param_bytes(self, part: Sequence[int], num_parts: int) -> list[int]:
        """Parameter bytes per part, as :meth:`segment_param_bytes` counts them; a parameter
        read on several parts counts on each."""
        positions: list[list[int]] = [[] for _ in range(num_parts)]
        for pos, p in enumerate(part):
            positions[p].append(pos)
        return [self._held_bytes(found) for found in positions]

    def transfers(self, part: Sequence[int], num_parts: int) -> tuple[list[int], list[int]]:
        """Per-step bytes sent and received per part: one copy per (blob, reading part).

        A graph input is fed on the part of its first reader and copied to the others;
        load-time values (computed from parameters alone) move nothing per step.
        """
        out = [0] * num_parts
        into = [0] * num_parts
        for size, home, p in self.copies(part):
            out[home] += size
            into[p] += size
        return out, into

    def copies(self, part: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        """``(bytes, from part, to part)`` of every per-step copy under ``part[pos]``: one per
        (blob, reading part other than the blob's own; a graph input's is its first reader's)."""
        for b, size in enumerate(self.step_bytes):
            consumers = self.blob_consumers[b]
            if not consumers or not size:
                continue
            home = part[self.blob_first[b]]
            for p in {part[c] for c in consumers}:
                if p != home:
                    yield size, home, p


def _last_before(positions: list[int], j: int) -> int:
    """The largest position ``< j`` in a sorted list (there is at least one)."""
    lo, hi = 0, len(positions)
    while lo < hi:
        mid = (lo + hi) // 2
        if positions[mid] < j:
            lo = mid + 1
        else:
            hi = mid
    return positions[lo - 1]


def _max_prefix(diff: list[int]) -> int:
    best = running = 0
    for delta in diff:
        running += delta
        if running > best:
            best = running
    return best


def peak_activation_bytes(model: Model, *, dims: Mapping[str, int] | None = None) -> dict[Device, int]:
    """Liveness-based peak activation bytes per device for the model's current placement.

    Symbolic dimensions count at ``dims`` (default: :func:`placement.planning.dims.planned_dims`).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> from placement.planning.profile import peak_activation_bytes
        >>> peaks = peak_activation_bytes(model)
        >>> list(peaks), peaks[pl.Device("cuda", 0)] > 0
        ([Device('cuda:0')], True)
    """
    info = GraphInfo(model, dims=dims)
    devices = sorted({node_device(n) for n in info.nodes})
    index = {d: k for k, d in enumerate(devices)}
    part = [index[node_device(n)] for n in info.nodes]
    return dict(zip(devices, info.peak_activations(part, len(devices))))


def add_kv_cache(info: GraphInfo, model: Model, kv_cache: tuple[int, int]) -> int:
    """Count each layer's KV cache at ``kv_cache = (batch, max_length)`` on the op making its
    present (where the cache lives); the bytes added.

    Raises:
        PlanError: a bad ``kv_cache`` or a model without a cache.
    """
    try:
        batch, length = (int(v) for v in kv_cache)
    except (TypeError, ValueError) as err:
        raise PlanError(f"kv_cache must be (batch, max_length), got {kv_cache!r}") from err
    if batch < 1 or length < 1:
        raise PlanError(f"kv_cache must be positive (batch, max_length), got {kv_cache!r}")
    layers = kv_layers(model)
    if not layers:
        raise PlanError("kv_cache= needs a model with a KV cache (pl.from_causal_lm)")
    outputs = {v.name: v for v in model.graph.outputs}
    added = 0
    for layer in layers:
        for name in (layer.present_key, layer.present_value):
            producer = outputs[name].producer()
            position = info.position.get(producer.name or "") if producer is not None else None
            if position is None:
                raise PlanError(f"cache output {name!r} is not made by a planned op")
            nbytes = layer.bytes_for(batch, length) // 2
            info.add_state(position, nbytes)
            added += nbytes
    return added
