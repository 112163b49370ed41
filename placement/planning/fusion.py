"""What a cut inside a fusable pattern costs: measured, per cut point.

ONNX Runtime fuses chains such as Conv + BatchNormalization (+ Add) (+ Relu) and
MatMul + Add (+ activation) into one kernel (and, for convolutions on the CPU, keeps
them in its blocked memory layout). A stage boundary inside such a chain makes each
half a separate session: the fusion is lost, and each side pays a layout conversion.

:func:`fusion_cut_costs` finds the chains in a model's graph order (each op the only
reader of the one before it, adjacent in the order) and, for every cut point inside
one, times the chain as one session against its two halves as two sessions (all
graph optimisations on, one intra-op thread, like the profiler). The difference,
split evenly between the two sides, is what the planner charges the part before and
the part after that cut (:class:`placement.planning.partition.PartitionProblem`'s
``cut_costs``). When the next chain follows at once, the timed window reaches
through it: the cut at the boundary between the two (a block boundary, which keeps the
fusions but still pays ONNX Runtime's layout conversions out of and back into its
blocked convolution layout) is timed too, and every cut has convolutions on both sides,
as inside a real stage.
Chains with the same op types, attributes and shapes are timed once.

:func:`fused_cuts` is the cheap, exact alternative used when planning for the ONNX
Runtime executor (``auto_place(runtime="ort")``): it asks ONNX Runtime itself which
blobs its graph optimisations fuse away and forbids every cut that one of them would
cross (plus cuts inside the chains above, which the CPU's blocked-layout convolutions
fuse at the highest level). No timing, so no noise; the cuts that remain are where an
optimised stage session starts and ends with the same fused kernels as the whole model.

Example:
    >>> import placement as pl
    >>> from placement.planning.graph_info import GraphInfo
    >>> from placement.planning.fusion import find_chains
    >>> from placement.models import resnet
    >>> model = pl.from_torch(*resnet.build("tiny"))
    >>> chains = find_chains(GraphInfo(model))
    >>> [GraphInfo(model).nodes[p].op_type for p in range(*chains[0])]
    ['Conv', 'BatchNormalization', 'Relu']
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import numpy as np

from placement.graph.model import Model
from placement.planning.graph_info import GraphInfo
from placement.planning.profile import fingerprint

__all__ = ["PATTERNS", "READ_BACK_LIMIT", "find_chains", "fused_cuts", "fusion_cut_costs"]

log = logging.getLogger(__name__)

_CACHE_KEY = "placement.fusion_cut_costs"
_FUSED_KEY = "placement.fused_cuts"

#: :func:`fused_cuts` reads ONNX Runtime's optimised graph back only for models with at
#: most this many bytes of weights (it is written to a temporary file, weights included).
READ_BACK_LIMIT = 2**31

_ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "Tanh", "Gelu", "FastGelu"})

#: Fusable chains: a head op type, then optional stages in order.
PATTERNS: tuple[tuple[frozenset[str], tuple[frozenset[str], ...]], ...] = (
    (
        frozenset({"Conv"}),
        (frozenset({"BatchNormalization"}), frozenset({"Add"}), _ACTIVATIONS),
    ),
    (frozenset({"MatMul", "Gemm"}), (frozenset({"Add"}), _ACTIVATIONS)),
)


def find_chains(info: GraphInfo, *, adjacent: bool = True) -> list[tuple[int, int]]:
    """Fusable chains as ``(start, end)`` position ranges (end exclusive, at least two chain ops).

    Each op of a chain is the only reader of the output of the one before it. With
    ``adjacent`` (what :func:`fusion_cut_costs` times) the chain's ops also follow one
    another in the graph order. Without it they may have other ops between them, as
    when an exporter computes a residual block's skip branch between its
    BatchNormalization and its Add: the range then spans the ops between, since a cut
    anywhere inside it splits the chain (what :func:`fused_cuts` forbids), and ranges
    may overlap. An op joins one chain at most (one fused kernel); an Add joins the chain
    ONNX Runtime folds it into, the one making its first input where that is a convolution
    (checked against ONNX Runtime's blocked-layout fusion).

    Example:
        >>> import onnx_ir as ir
        >>> import placement as pl
        >>> from onnx import TensorProto, helper
        >>> graph = helper.make_graph(
        ...     [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        ...      helper.make_node("Conv", ["y", "w"], ["skip"], name="skip"),
        ...      helper.make_node("Add", ["c", "skip"], ["s"], name="add"),
        ...      helper.make_node("Relu", ["s"], ["r"], name="relu")],
        ...     "block",
        ...     [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 4, 4]) for n in "xy"],
        ...     [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
        ...     [helper.make_tensor("w", TensorProto.FLOAT, [2, 2, 1, 1], [1.0] * 4)],
        ... )
        >>> model = pl.Model(ir.serde.deserialize_model(helper.make_model(graph)))
        >>> info = GraphInfo(model)
        >>> find_chains(info), find_chains(info, adjacent=False)
        ([(1, 4)], [(0, 4)])
    """
    chains = []
    claimed: set[int] = set()  # ops already in a chain
    n = len(info)
    for pos in range(n):
        if pos in claimed:
            continue
        stages = next((rest for head, rest in PATTERNS if info.nodes[pos].op_type in head), None)
        if stages is None:
            continue
        last, members = pos, []
        for stage in stages:
            nxt = _sole_reader(info, last) if not adjacent else last + 1
            if (
                nxt is not None
                and nxt < n
                and nxt not in claimed
                and info.nodes[nxt].op_type in stage
                and _feeds_only(info, last, nxt)
                and (adjacent or info.nodes[nxt].op_type != "Add" or _add_joins(info, last, nxt))
            ):
                last = nxt
                members.append(nxt)
        if members:
            chains.append((pos, last + 1))
            claimed.update(members)
    return chains


def _add_joins(info: GraphInfo, last: int, add: int) -> bool:
    """Whether ONNX Runtime folds ``add`` into the convolution chain ending at ``last``: it
    takes the Add into the producer of its first input when that is a convolution (or its
    BatchNormalization) read only by the Add, else into the producer of the second."""
    ins = info.op_inputs[add]
    if not ins:
        return False
    if ins[0] in info.op_outputs[last]:
        return True
    first = info.blob_producer[ins[0]]
    takes_first = (
        first >= 0
        and info.nodes[first].op_type in ("Conv", "BatchNormalization")
        and info.blob_consumers[ins[0]] == [add]
    )
    return not takes_first and len(ins) > 1 and ins[1] in info.op_outputs[last]


def _sole_reader(info: GraphInfo, src: int) -> int | None:
    """The op reading an output of ``src`` that only it reads (see :func:`_feeds_only`)."""
    for b in info.op_outputs[src]:
        consumers = info.blob_consumers[b]
        if len(set(consumers)) == 1 and consumers[0] > src and not info.blob_is_output[b]:
            return consumers[0]
    return None


def _feeds_only(info: GraphInfo, src: int, dst: int) -> bool:
    """``dst`` reads an output of ``src`` that nothing else reads and is no graph output."""
    for b in info.op_outputs[src]:
        if info.blob_consumers[b] == [dst] and not info.blob_is_output[b]:
            return True
    return False


def fused_cuts(model: Model, info: GraphInfo | None = None) -> list[bool]:
    """Allowed cut points ``0..n``: False where a cut would split a group ONNX Runtime fuses.

    The model is optimised once by ONNX Runtime (``ORT_ENABLE_EXTENDED``, the CPU
    provider; nothing is run) and the optimised graph's value names are read back:
    ONNX Runtime keeps the name of every blob that still exists after its fusions
    (a fused node computes its last op's output under that op's output name), so a
    data-dependent blob that is gone was computed *inside* a fused kernel
    (``MatMul`` + ``Mul`` as ``FusedMatMul``, ``Add`` + ``Gelu`` as ``BiasGelu``,
    ``Conv`` + ``BatchNormalization``, ``Add`` + ``LayerNormalization`` as
    ``SkipLayerNormalization``, ...). A cut that such a blob would cross is forbidden.
    The level above (``ORT_ENABLE_ALL``) also folds ``Add`` and the activation after a
    convolution into its blocked-layout (NCHWc) kernel under a renamed value, so cuts
    inside :func:`find_chains`' chains are forbidden as well (``adjacent=False``: other
    ops, such as a skip branch, may sit between a chain's ops). Load-time blobs (computed
    from parameters alone) are ignored: they never cross a cut at run time.

    When the model cannot be optimised and read back (ONNX Runtime rejects it), or its
    weights exceed :data:`READ_BACK_LIMIT` (ONNX Runtime writes the optimised model
    with its weights to disk), only the chains are forbidden (logged). Cached on the
    model per structure fingerprint.

    Example:
        >>> import placement as pl
        >>> from placement.models import resnet
        >>> model = pl.from_torch(*resnet.build("tiny"))
        >>> info = GraphInfo(model)
        >>> allowed = fused_cuts(model, info)
        >>> conv = next(p for p in range(len(info)) if info.nodes[p].op_type == "Conv")
        >>> info.nodes[conv + 1].op_type, allowed[conv + 1]  # Conv | BatchNormalization: fused
        ('BatchNormalization', False)
    """
    fp, cached = _cached(model, _FUSED_KEY)
    if cached is not None:
        return cached
    info = info if info is not None else GraphInfo(model)
    n = len(info)
    allowed = [True] * (n + 1)
    for start, end in find_chains(info, adjacent=False):
        for c in range(start + 1, end):
            allowed[c] = False
    weights = sum(info.param_bytes)
    alive = None
    if weights > READ_BACK_LIMIT:
        log.info("fusion: %d bytes of weights; only chains are kept whole", weights)
    else:
        try:
            alive = _optimized_value_names(model)
        except Exception as err:  # ORT rejects the model: keep the chains only
            log.info(
                "fusion: cannot read ONNX Runtime's optimised graph (%s); only chains are kept whole", err
            )
    if alive is not None:
        # a blob made (or first fed) at position p and last read at q crosses cuts p+1..q
        diff = [0] * (n + 2)
        for b, consumers in enumerate(info.blob_consumers):
            if not consumers or info.blob_names[b] in alive:
                continue
            producer = info.blob_producer[b]
            if producer >= 0 and not info.data_dependent[producer]:
                continue
            first = info.blob_first[b]
            if consumers[-1] > first:
                diff[first + 1] += 1
                diff[consumers[-1] + 1] -= 1
        crossing = 0
        for c in range(n + 1):
            crossing += diff[c]
            if crossing:
                allowed[c] = False
    allowed[0] = allowed[n] = True
    log.info("fusion: %d of %d cut points split a fused group", allowed.count(False), max(n - 1, 0))
    _remember(model, _FUSED_KEY, fp, allowed)
    return allowed


def _optimized_value_names(model: Model) -> set[str]:
    """Names of the values in ONNX Runtime's optimised graph of ``model`` (CPU, extended level)."""
    import os
    import shutil
    import tempfile

    import onnx
    import onnxruntime as ort

    from placement.graph.session import ort_session

    tmp = tempfile.mkdtemp(prefix="placement-fused-")
    try:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        # the optimised model's weights go to a side file that is never read back
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "weights.bin"
        )
        ort_session(model, options, ["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    names = {v.name for v in optimized.graph.input} | {v.name for v in optimized.graph.output}
    for node in optimized.graph.node:
        names.update(node.input)
        names.update(node.output)
    return names


def fusion_cut_costs(
    model: Model, info: GraphInfo | None = None, *, repeats: int = 5
) -> list[tuple[int, int]]:
    """Per cut position ``0..n``, ``(cost to the part before, cost to the part after)`` in ns.

    Zero outside fusable chains. Timing failures (an op ONNX Runtime cannot run
    alone) leave that chain at zero and are logged. Cached on the model per
    structure fingerprint (like the profile), so placing ops keeps it valid.
    """
    fp, cached = _cached(model, _CACHE_KEY)
    if cached is not None:
        return cached
    info = info if info is not None else GraphInfo(model)
    n = len(info)
    result = [(0, 0)] * (n + 1)
    chains = find_chains(info)
    if not chains:
        _remember(model, _CACHE_KEY, fp, result)
        return result
    measured: dict[Any, list[int]] = {}
    try:
        timer = _SegmentTimer(model, repeats=max(5, 2 * repeats))
    except Exception as err:  # e.g. a model too large to serialise in one piece: no cut costs
        log.info("fusion: cannot extract pieces of the model (%s); cuts cost nothing extra", err)
        return result
    for k, (start, end) in enumerate(chains):
        # the window reaches through the next chain when it follows at once, so the cut
        # at the boundary is timed too, and every cut sees a convolution on both sides
        stop = chains[k + 1][1] if k + 1 < len(chains) and chains[k + 1][0] == end else end
        key = (_signature(info, start, end), _signature(info, end, stop) if stop > end else None)
        extra = measured.get(key)
        if extra is None:
            cuts = list(range(start + 1, end + (1 if stop > end else 0)))
            try:
                extra = timer.cut_costs(info, start, stop, cuts)
            except Exception as err:  # ORT rejects some stand-alone pieces; such chains cost 0
                log.debug("fusion: cannot time chain at %s: %s", info.names[start], err)
                extra = [0] * len(cuts)
            measured[key] = extra
        for offset, ns in enumerate(extra):
            c = start + 1 + offset
            result[c] = (ns - ns // 2, ns // 2)
    log.info(
        "fusion: %d fusable chains (%d distinct), cuts inside cost up to %.3f ms",
        len(chains),
        len(measured),
        max((a + b for a, b in result), default=0) / 1e6,
    )
    _remember(model, _CACHE_KEY, fp, result)
    return result


def _cached(model: Model, key: str) -> tuple[str, list[Any] | None]:
    """(the model's structure fingerprint, a copy of what is cached under ``key`` for it or None)."""
    fp = fingerprint(model)
    cached = model.ir_model.meta.get(key)
    if isinstance(cached, tuple) and cached[0] == fp:
        return fp, list(cached[1])
    return fp, None


def _remember(model: Model, key: str, fp: str, value: list[Any]) -> None:
    """Cache a copy of ``value`` on the model under ``key`` for structure ``fp``."""
    model.ir_model.meta[key] = (fp, list(value))


def _signature(info: GraphInfo, start: int, end: int) -> Any:
    parts = []
    for pos in range(start, end):
        node = info.nodes[pos]
        attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
        shapes = tuple(
            None if v is None or v.shape is None else (str(v.dtype), tuple(str(d) for d in v.shape))
            for v in node.inputs
        )
        parts.append((node.op_type, attrs, shapes))
    return tuple(parts)


class _SegmentTimer:
    """Times contiguous pieces of the model's graph order as stand-alone sessions."""

    def __init__(self, model: Model, *, repeats: int) -> None:
        import onnx.utils

        from placement.graph.weights import split_weights

        self.repeats = repeats
        self._call: float | None = None
        # every weight in the proto: a data-file reference would be resolved by ORT in the working folder
        proto, _ = split_weights(model, threshold=sys.maxsize)
        self.extractor = onnx.utils.Extractor(proto)

    def _session(self, info: GraphInfo, start: int, end: int) -> tuple[Any, dict[str, np.ndarray]]:
        """A session running ops ``start..end-1`` alone, and random feeds for it."""
        import onnxruntime as ort

        names = {info.blob_names[b] for pos in range(start, end) for b in info.op_inputs[pos]}
        made = {info.blob_names[b] for pos in range(start, end) for b in info.op_outputs[pos]}
        inputs = sorted(names - made)
        outputs = [info.blob_names[b] for b in info.op_outputs[end - 1]]
        proto = self.extractor.extract_model(inputs, outputs)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {}
        for arg in session.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in arg.shape]
            dtype = _NUMPY.get(arg.type, np.float32)
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        session.run(None, feeds)  # warm-up
        return session, feeds

    def _fastest(self, runs: list[list[tuple[Any, dict[str, np.ndarray]]]]) -> list[float]:
        """Per group of sessions run back to back, the fastest time of the group over
        ``repeats`` rounds; groups alternate round by round, so load on a shared machine
        hits them alike, and the minimum is the least disturbed run."""
        best = [math.inf] * len(runs)
        clock = time.perf_counter_ns
        for _ in range(self.repeats):
            for k, group in enumerate(runs):
                t0 = clock()
                for session, feeds in group:
                    session.run(None, feeds)
                best[k] = min(best[k], clock() - t0)
        return best

    def call_overhead(self) -> float:
        """The time of one session call that computes nothing (a cut anywhere pays it)."""
        if self._call is None:
            import onnx
            import onnxruntime as ort
            from onnx import TensorProto, helper

            graph = helper.make_graph(
                [helper.make_node("Identity", ["x"], ["y"])],
                "empty",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
            )
            proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
            onnx.checker.check_model(proto)
            session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
            self._call = self._fastest([[(session, {"x": np.zeros(1, np.float32)})]])[0]
        return self._call

    def cut_costs(self, info: GraphInfo, start: int, end: int, cuts: list[int]) -> list[int]:
        """Per cut in ``cuts``: ops ``start..end-1`` as two sessions minus as one (ns)."""
        whole = [self._session(info, start, end)]
        groups = [whole] + [[self._session(info, start, c), self._session(info, c, end)] for c in cuts]
        times = self._fastest(groups)
        overhead = self.call_overhead()
        return [max(0, int(apart - overhead - times[0])) for apart in times[1:]]


_NUMPY: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}
