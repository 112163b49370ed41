"""Lower a placed model to PyTorch: ``to_torch(model) -> torch.fx.GraphModule``.

The ONNX graph is walked once in topological order and a ``torch.fx.Graph`` is
built by hand: a placeholder per graph input, ``get_attr`` for parameters and
constants, one ``call_function`` per op to its rule in
:data:`placement.lowering.ops.RULES`, and ``.to(device, non_blocking=True)``
for copies. The result is an ordinary ``torch.nn.Module`` with readable ``.code``
that supports autograd.

Where a rule offers a *direct* form and the instance allows it, the plain torch
call is emitted instead of the rule (``x.permute(0, 2, 1, 3)``,
``w[idx]``, ``F.layer_norm(x, (768,), w, b, 1e-05)``, ``x.masked_fill(mask, -inf)``),
so the code reads like hand-written torch and costs no wrapper call. The
exporter's split of ``nn.Linear`` into ``MatMul`` + ``Add`` (bias) is fused back
into ``F.linear`` (eager's single ``addmm``), using the weight itself when the
MatMul reads ``W.permute(1, 0)``. Static shapes come from the IR or, where the
exporter left a value without one, from running the rules on meta tensors.

This module is the front door (:func:`to_torch`, :func:`check_supported`) and lowers
the whole model's inputs, initializers and outputs. The machinery beneath it, one
concern per module: :mod:`.values` (a blob during lowering, and the conversions of
names and data), :mod:`.opset` (converting models older than opset 13),
:mod:`.emit` (the fx graph's attributes, parameters, constants and copies),
:mod:`.walker` (lowering one op: folding, rules, shapes, the interface of a rule's
``emit``) and :mod:`.bodies` (op subgraphs lowered into modules of their own).

Design choices:

* **Devices.** Every logical device goes through
  :func:`~placement.runtime.device_map.resolve_device_map`. Each value knows its
  logical device; an op on device ``d`` reads its inputs on ``d``'s physical
  device. Explicit copies (``Copy`` ops from ``inject_cross_device_copies``)
  always become ``.to(...)``. A cross-device edge *without* a copy also gets a
  ``.to(...)`` when the physical devices differ (logged at debug level), so
  unplaced-copy models lower correctly too. ``non_blocking=True`` is used except
  for GPU -> CPU copies, where it would let the CPU read unfinished data. Each
  emitted node records its op's logical device in ``node.meta[DEVICE_META]``
  (:mod:`placement.lowering.meta`)
  (for splits by device).
* **Inputs and outputs.** Graph inputs are moved to their device on entry (a
  no-op when already there); graph outputs are moved to the model's output
  device when one is set. One output is returned as a tensor, several as a tuple.
  A call then hands them back on its first tensor input's device
  (``outputs_on="input"``, :mod:`.outputs`) or leaves them there (``"last"``).
* **Parameters.** Floating-point initializers with at least one dimension become
  ``nn.Parameter`` (``requires_grad=True``) on the physical device of their home
  logical device (``Model.parameters[name].device``), registered under their
  original dotted names (``blocks.0.attn.c_attn.bias`` -> submodule
  ``blocks.0.attn.c_attn``, parameter ``bias``). Static copies of a parameter
  stay ``.to(...)`` calls in ``forward``: free when the devices coincide, and a
  parameter used on two GPUs stays one ``nn.Parameter`` that training updates
  once (materializing per-device replicas would silently split it).
* **Constants.** Integer/bool initializers, 0-d initializers, BatchNorm running
  statistics (a rule's ``buffer_inputs``), ``Constant`` ops and
  everything computed only from them (shape arithmetic, and ``Shape`` of a value
  whose shape is static) are folded at lowering time. A folded constant is then
  inlined as a Python literal where the rule allows it (shapes, axes, scalars:
  ``reshape(x, [2, 8, 4, 8])``, ``x * 0.125``) or else registered as a buffer on
  each physical device that reads it (first device: the blob's name; others:
  ``<name>__<device>``).
* **Names.** Attribute paths are the ONNX names with each dot-separated part
  kept when it is a usable attribute name; otherwise (empty parts, a clash with
  an ``nn.Module`` attribute, or a name that is both a tensor and a prefix of
  another) the whole name is flattened with ``.`` -> ``_`` and made unique. The
  full mapping is ``module.initializer_paths`` (ONNX name -> attribute path).
  FX node names come from output blob names.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(3, 4)
    >>> model = pl.from_torch(net, (x,))
    >>> model.set_device(model.ops[-1].name, 1)  # last Gemm on logical cuda:1
    >>> module = pl.to_torch(model, device_map="cpu")
    >>> torch.allclose(module(x), net(x), atol=1e-6)
    True
    >>> sorted(name for name, _ in module.named_parameters())
    ['0.bias', '0.weight', '2.bias', '2.weight']
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import onnx_ir as ir
import torch
import torch.fx as fx

from placement.errors import CUDAGraphError, LoweringError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.graph.torch_import import exporter_constants, mode_modules
from placement.lowering.bodies import Lowering, graph_module
from placement.lowering.ops import DEFAULT_RULE, get_rule, torch_dtype
from placement.lowering.opset import upgraded
from placement.lowering.values import Val, attr_python, identifier, to_torch_tensor
from placement.runtime.device_map import DeviceMapLike, resolve_device_map
from placement.runtime.torch.concurrent import check_concurrent, concurrent_pays
from placement.runtime.torch.executor import check_executor
from placement.runtime.torch.outputs import check_outputs_on, install_outputs_on
from placement.runtime.torch.pickled import FORWARD_HOOKS, PRESERVED, PlacedGraphModule
from placement.runtime.torch.stream_release import insert_readers, insert_releases
from placement.runtime.torch.streaming import WeightStreamer, pin_streamed
from placement.runtime.torch.train_mode import install_mode_warning

__all__ = ["to_torch", "check_supported"]

log = logging.getLogger(__name__)


def to_torch(
    model: Model,
    *,
    device_map: DeviceMapLike = "auto",
    chunks: int = 1,
    checkpoint: str = "except_last",
    batch_axes: Mapping[str, int | None] | None = None,
    cuda_graphs: bool = False,
    outputs_on: str = "input",
    executor: str = "auto",
    concurrent: bool | None = None,
) -> torch.nn.Module:
    """Lower a (placed) model to a ``torch.fx.GraphModule``.

    Args:
        model: the model; its ops may sit on several logical devices, with or
            without explicit copies.
        device_map: logical -> physical devices, see
            :func:`~placement.runtime.device_map.resolve_device_map` (``"auto"``:
            real GPUs when present, else every logical device emulated on the CPU).
        chunks: with ``chunks > 1``, return a pipelined module
            (:class:`~placement.runtime.torch.pipelined.PipelinedModule`):
            its forward splits the batch into ``chunks`` micro-batches that run
            through the per-stage submodules concurrently (GPipe's fill-drain
            schedule, one worker per stage) and its backward runs the stages
            in reverse the same way; outputs and gradients equal the unsplit module's.
        checkpoint: with ``chunks > 1``: ``"always"``, ``"except_last"`` (the
            default, as GPipe) or ``"never"``: which micro-batches drop their
            activations in forward and recompute them in backward.
        batch_axes: input/output name -> batch axis, replacing the detection
            from the graph's symbolic batch dimension (see
            :func:`placement.runtime.schedule.batch_axes`).
        cuda_graphs: with ``chunks=1``, return a
            :class:`~placement.runtime.torch.cuda_graphs.CUDAGraphModule`: each run of
            ops on one GPU is captured as a CUDA graph per input shape and replayed
            (inference: with gradients enabled it runs eagerly); see
            :mod:`placement.runtime.torch.cuda_graphs`. With ``chunks > 1``, each
            GPU stage replays a graph per micro-batch shape, forward and (where its
            backward follows at once) backward; stages on the CPU run eagerly, with a
            warning when no stage is on a GPU; see
            :mod:`placement.runtime.torch.stage_graphs`.
        outputs_on: where a call's outputs come back: ``"input"`` (the default) on the
            device of its first tensor input, as accelerate's dispatched modules do (CPU
            tensors in, CPU tensors out, whatever devices the stages run on); ``"last"``
            on the last stage's device, for chaining more work there without a round
            trip. The move is inside autograd (gradients flow back through it), and a
            pipelined module's ``train_step`` hands ``loss_fn`` the outputs there too;
            see :mod:`placement.runtime.torch.outputs`.
        executor: with ``chunks > 1``, who runs the stages: ``"threads"`` (a worker
            thread per stage), ``"inline"`` (the caller's thread runs every stage in the
            schedule's order; on GPUs each still on its own stream) or ``"auto"`` (the
            default: inline for GPU stages and for host stages too small to pay for
            thread hand-offs); see :mod:`placement.runtime.torch.executor`. Same
            outputs and gradients bit for bit.
        concurrent: whether stages that do not depend on each other (the per-device
            branches of a tensor-parallel layer, :func:`placement.split_tensor_parallel`)
            run at the same time, each on a worker thread of its own with its share of the
            cores, forward and backward; see :mod:`placement.runtime.torch.concurrent`.
            ``None`` (the default): where it pays (the stage graph is wider than a chain,
            every stage on the host, and the executor runs stages on threads); ``True``:
            wherever the stage graph is wider than a chain on the host; ``False``: never
            (the stages run one after another). With ``chunks=1`` a model whose stages run
            at once lowers to a one-micro-batch pipelined module (no ``.code``; same
            parameters, outputs and gradients); otherwise to the ``GraphModule`` below.

    Returns:
        A ``torch.fx.GraphModule``: call it with the graph inputs (positionally in
        ``module.input_names`` order, or by keyword with those names made valid
        identifiers) to get the output tensor, or a tuple of tensors when the
        graph has several outputs. It also carries
        ``input_names``, ``output_names``, ``device_map`` (logical -> physical
        device strings) and ``initializer_paths``.

    Raises:
        LoweringError: op types without a rule (all of them, named with an
            example op each), unsupported attributes, or an opset older than 13 that
            ``onnx.version_converter`` cannot convert.
        DeviceError: a bad ``device_map`` or ``outputs_on``.
        CUDAGraphError: ``cuda_graphs=True`` and ``chunks=1`` without a GPU in the device map,
            or ``cuda_graphs=True`` with streamed weights (:func:`placement.stream_parameters`).

    The module (``chunks=1``) checks its inputs as :class:`placement.Runner` does: a
    wrong dtype, rank or static dimension raises :class:`placement.InputError`
    naming the input (see :mod:`placement.runtime.torch.input_check`).

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Softmax(-1))
        >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(1, 4),)), device_map="cpu")
        >>> print(module.code.strip().splitlines()[0])
        def forward(self, input):
    """
    if not isinstance(model, Model):
        raise TypeError(f"to_torch lowers a placement.Model, got {type(model).__name__}")
    check_outputs_on(outputs_on)
    check_executor(executor)
    check_concurrent(concurrent, executor)
    model, problems = upgraded(model, device=_logical_devices(model)[0])
    check_supported(model, problems=problems)
    devices = _logical_devices(model)
    dmap = resolve_device_map(devices, device_map, runtime="torch")
    if cuda_graphs and model.streamed:
        named = ", ".join(sorted(model.streamed)[:3]) + (", ..." if len(model.streamed) > 3 else "")
        raise CUDAGraphError(
            f"cuda_graphs=True cannot run streamed weights ({named}): a graph would capture the "
            "streamer's waits and replay one copy schedule for ever; lower without cuda_graphs, "
            "or keep these weights resident"
        )
    module = _ModelLowering(model, dmap).build()
    physical = [str(dmap[d]) for d in devices if d in dmap]
    as_dag = chunks == 1 and not cuda_graphs and concurrent_pays(model, physical, concurrent, executor)
    if chunks == 1:  # a pipelined module's batch may be several graph batches: its stages check
        from placement.runtime.inputs import input_specs
        from placement.runtime.torch.input_check import install_input_check

        specs = input_specs(model.graph)
        keywords = [str(n.target) for n in module.graph.nodes if n.op == "placeholder"][: len(specs)]
        install_input_check(module, specs, keywords)
    layers = mode_modules(model)
    if chunks != 1 or as_dag:  # several micro-batches, or one through stages that run at once
        from placement.runtime.torch.pipelined import pipeline_module

        pipelined = pipeline_module(
            model,
            module,
            chunks=chunks,
            checkpoint=checkpoint,
            batch_axes=batch_axes,
            cuda_graphs=cuda_graphs,
            executor=executor,
            concurrent=concurrent,
        )
        if as_dag:  # one micro-batch is one graph batch: checked as the plain module is
            install_input_check(pipelined, specs, keywords)
        return install_mode_warning(install_outputs_on(pipelined, outputs_on), layers)
    if cuda_graphs:
        from placement.runtime.torch.cuda_graphs import cuda_graph_module

        return install_mode_warning(install_outputs_on(cuda_graph_module(module), outputs_on), layers)
    install_outputs_on(module, outputs_on)
    install_mode_warning(module, layers)
    # copy.deepcopy rebuilds a GraphModule without its forward hooks (the input check, the
    # outputs' move): keep them, and the choice, among the attributes it restores (a pickle
    # keeps them by PlacedGraphModule.__reduce__).
    kept = {key: module.__dict__[key] for key in FORWARD_HOOKS if key in module.__dict__}
    module.meta.setdefault(PRESERVED, {}).update(
        kept, outputs_on=outputs_on, mode_warning=module.mode_warning
    )
    log.info(
        "lowered %d ops to torch on %s",
        model.graph.num_nodes(),
        ", ".join(f"{d}->{p}" for d, p in sorted(dmap.items())),
    )
    return module


def check_supported(model: Model, *, problems: list[str] | None = None) -> None:
    """Raise one ``LoweringError`` naming every op type and attribute the lowering cannot handle.

    ``problems`` are earlier findings (an opset conversion that failed) listed first.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> model = pl.from_torch(torch.nn.ReLU(), (torch.randn(2),))
        >>> check_supported(model)  # fine: Relu has a rule
    """
    problems = list(problems or ())
    missing: dict[str, tuple[str, int]] = {}
    bad_attrs: dict[str, str] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):  # Loop/Scan bodies, If branches too
        rule = get_rule(node.op_type, node.domain)
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        if rule is DEFAULT_RULE:
            example, count = missing.get(key, (node.name or "?", 0))
            missing[key] = (example, count + 1)
            continue
        attrs = {name: attr_python(attr) for name, attr in node.attributes.items()}
        unknown = sorted(set(attrs) - (rule.params or frozenset()))
        if unknown:
            bad_attrs.setdefault(f"{key}: attribute(s) {', '.join(unknown)}", node.name or "?")
        elif rule.check is not None:
            issue = rule.check(attrs)
            if issue:
                bad_attrs.setdefault(f"{key}: {issue}", node.name or "?")
    for kind, values in (("input", model.graph.inputs), ("output", model.graph.outputs)):
        for value in values:
            if value.dtype is None or value.name in model.graph.initializers:
                continue
            try:
                torch_dtype(int(value.dtype))
            except LoweringError:
                problems.append(
                    f"graph {kind} {value.name!r} has type {value.dtype.name}, which torch has no tensors of"
                )
    if missing:
        listed = "; ".join(
            f"{key} (e.g. op {example!r}{f', {count} ops' if count > 1 else ''})"
            for key, (example, count) in sorted(missing.items())
        )
        problems.append(f"unsupported op types: {listed}")
    if bad_attrs:
        listed = "; ".join(f"{what} (e.g. op {example!r})" for what, example in sorted(bad_attrs.items()))
        problems.append(f"unsupported attributes: {listed}")
    if problems:
        raise LoweringError("cannot lower to torch: " + " | ".join(problems))


def _logical_devices(model: Model) -> list[Device]:
    devices = set(model.devices) | set(model.streamed.values())
    for extra in (model.input_device, model.output_device):
        if extra is not None:
            devices.add(extra)
    return sorted(devices) or [Device("cuda", 0)]


class _ModelLowering(Lowering):
    """Lowers the whole model: its inputs, initializers, ops in order and outputs."""

    def new_streamer(self, window: int | None) -> torch.nn.Module:
        return WeightStreamer([], window=window)

    def build(self) -> fx.GraphModule:
        model = self.model
        self._inputs()
        self._initializers()
        for node in model.graph:
            self.current_op = node.name
            self._lower(node)
        self.current_op = None
        self._outputs()
        module = graph_module(self.root, self.graph, "PlacedModule", cls=PlacedGraphModule)
        if self.streamer is not None:
            paths = [self.paths[name] for name in self.streamed_sources]
            pin_streamed(module, sorted(set(paths)))
            self.streamer.bind([module.get_parameter(path) for path in paths])
            op_types = {node.name or "": node.op_type for node in model.graph}
            insert_readers(module, self.streamer_path, op_types)
            insert_releases(module, self.streamer_path, op_types)
        present = {name for name, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        for path in self.transient & present:
            owner, _, leaf = path.rpartition(".")
            module.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
        extras = {
            "input_names": list(model.inputs),
            "output_names": list(model.outputs),
            "device_map": {str(k): str(v) for k, v in sorted(self.dmap.items())},
            "initializer_paths": {k: v for k, v in self.paths.items() if v in present},
        }
        for name, value in extras.items():
            setattr(module, name, value)
        module.meta.setdefault(PRESERVED, {}).update(extras)  # survive copy.deepcopy
        return module

    def _inputs(self) -> None:
        inits = self.model.graph.initializers
        for value in self.model.graph.inputs:
            name = value.name or ""
            if name in inits:
                continue
            placeholder = self.graph.placeholder(identifier(name, "input"))
            device = self.model.blob_device(value)
            phys = self._phys(device)
            self.current_device = device
            moved = self._create(  # to the CPU it blocks: the caller's tensor may be on a GPU
                "call_method",
                "to",
                (placeholder, phys),
                {} if phys == "cpu" else {"non_blocking": True},
                f"{placeholder.name}_on_{phys}",
            )
            self.values[name] = Val(name, node=moved, device=device)

    def _initializers(self) -> None:
        params = self.model.parameters
        state = _state_initializers(self.model)
        streamed = self.model.streamed
        for name, value in self.model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None:
                raise LoweringError(f"initializer {name!r} has no data")
            data = to_torch_tensor(tensor)
            trainable = data.is_floating_point() and data.dim() >= 1 and name not in state
            if trainable or name in streamed:  # a streamed integer weight: a frozen parameter
                home = params[name].device if name in params else self.default_device
                self.values[name] = Val(name, device=home)
                self.pending_params[name] = data
            else:
                self.values[name] = Val(name, const=data)

    def _outputs(self) -> None:
        results: list[fx.Node] = []
        out_device = self.model.output_device
        for value in self.model.graph.outputs:
            val = self.values.get(value.name or "")
            if val is None:
                raise LoweringError(f"graph output {value.name!r} is never produced")
            self.current_device = out_device or val.device
            if out_device is not None:
                target = self._phys(out_device)
            elif val.device is not None:
                target = self._phys(val.device)
            else:
                target = self._phys(self.model.blob_device(value))
            results.append(self._on(val, target))
        self.graph.output(results[0] if len(results) == 1 else tuple(results))


def _state_initializers(model: Model) -> set[str]:
    """Initializers that are never trainable: those fed to a rule's ``buffer_inputs`` (e.g.
    BatchNorm running stats) and the exporter's own constants (a ``bias=False`` conv's zero
    bias, see :func:`placement.graph.torch_import.exporter_constants`)."""
    inits = model.graph.initializers
    found: set[str] = set(exporter_constants(model)) & set(inits)
    for node in model.graph:
        positions = get_rule(node.op_type, node.domain).buffer_inputs
        for i in positions:
            if i < len(node.inputs):
                value = node.inputs[i]
                if value is not None and value.name in inits:
                    found.add(value.name)
    return found
