"""Import a PyTorch module through ``torch.onnx.export``.

The dynamo exporter (``dynamo=True``) comes first; where it fails (data-dependent
control flow, ops torch.export cannot trace), the TorchScript exporter
(``dynamo=False``) is tried: it traces the module with the example inputs, names
parameters after the module (kept as initializer names) and names each node
after its module path (``/encoder/block.0/layer.0/...``), from which op scopes are
recovered. The exporter used is logged and recorded on the model
(:func:`exporter_of`). Known gaps between library defaults and the exporter (custom
ops without an ONNX function, settings that cannot be exported, such as Hugging
Face's mixture-of-experts implementations) are bridged by
:mod:`placement.graph.export_rules`.

Example:
    >>> import torch
    >>> import placement as pl
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> model = pl.from_torch(net, (torch.randn(2, 4),))
    >>> [op.op_type for op in model.ops]
    ['Gemm', 'Relu']
    >>> sorted(model.parameters)
    ['0.bias', '0.weight']
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from placement.errors import ExportError
from placement.graph.device import Device, DeviceLike
from placement.graph.export_rules import EXPERT_KEY, exportable_settings, translation_table
from placement.graph.inference import infer_types
from placement.graph.model import Model
from placement.graph.nodes import SCOPE_KEY, scope_from_torch_name_scopes
from placement.graph.output_names import rename_outputs, structure_names

__all__ = [
    "CONSTANTS_KEY",
    "COUNTERS_KEY",
    "CUMULATIVE_KEY",
    "EXPORTER_KEY",
    "MODE_MODULES_KEY",
    "TRAINING_KEY",
    "exporter_constants",
    "exporter_of",
    "from_torch",
    "mode_modules",
]

#: Model metadata key naming the exporter that produced an imported model
#: (``"dynamo"`` or ``"torchscript"``).
EXPORTER_KEY = "placement.exporter"
#: Model metadata key listing (as a JSON array) the initializers that are not the
#: module's ``state_dict``: what the exporter made (the zero bias of a ``bias=False``
#: convolution, folded constants such as ``val_6``, lifted tensor constants) and the
#: module's non-persistent buffers. Runtimes treat them as constants, never as trainable
#: parameters, and leave them out of a lowered module's ``state_dict``.
CONSTANTS_KEY = "placement.constants"
#: Model metadata key set to ``"1"`` on a model exported for training
#: (``from_torch(..., training=True)``): its Dropout and BatchNormalization ops follow the
#: lowered module's train/eval mode (:mod:`placement.lowering.ops.training`).
TRAINING_KEY = "placement.training"
#: Model metadata key listing (JSON) the module's layer types that behave differently in
#: training (Dropout, BatchNorm), recorded by an eval-mode export so that training the
#: lowered module can warn that they run in eval mode.
MODE_MODULES_KEY = "placement.mode_modules"
#: Model metadata key of a training export: BatchNorm module path -> its ``num_batches_tracked``
#: (JSON), so the lowered module keeps and counts that buffer under the module's name.
COUNTERS_KEY = "placement.batch_counters"
#: Model metadata key of a training export: the paths of the BatchNorm modules with
#: ``momentum=None`` (a cumulative moving average, ``1 / num_batches_tracked``), as JSON.
CUMULATIVE_KEY = "placement.cumulative_batchnorms"
_EXPORTERS = ("auto", "dynamo", "torchscript")

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CALL_SUFFIX = re.compile(r"_[0-9]+$")
_HINT = (
    "try: pass example inputs of the exact shapes and dtypes you will run, make "
    "data-dependent control flow static, or export the model to ONNX yourself and "
    "use pl.load()"
)


def from_torch(
    module: Any,
    args: Sequence[Any] | Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    device: DeviceLike = 0,
    dynamic_shapes: Any = None,
    exporter: str = "auto",
    training: bool = False,
    output_names: Sequence[str] | None = None,
) -> Model:
    """Export ``module`` to an operator graph with every op on ``device``.

    The module is exported in eval mode (its training flags are restored
    afterwards, so the module is unchanged), or with ``training=True`` in train
    mode: its Dropout ops are kept and its BatchNorm ops stand for batch
    statistics, so the module ``pl.to_torch`` lowers from it follows
    ``module.train()``/``module.eval()`` (see :mod:`placement.lowering.ops.training`).
    The ONNX Runtime path runs such a model in inference mode. Initializers keep the module's
    parameter names (a parameter shared by two modules, like a tied LM head,
    is one initializer); constant shape arithmetic is folded but parameters
    never are. Each op records the module path that produced it (``op.scope``).
    A setting the exporter cannot handle (a Hugging Face mixture-of-experts model's
    ``experts_implementation="eager"``, a causal LM's default ``use_cache=True``) is
    switched to an exportable one for the export, with a logged notice, and restored
    afterwards (:mod:`placement.graph.export_rules`). To export a causal LM *with* its
    KV cache, use :func:`placement.graph.causal_lm.from_causal_lm`.

    Args:
        module: a ``torch.nn.Module``.
        args: example positional inputs (a tuple, or a single tensor).
        kwargs: example keyword inputs.
        device: the device every op starts on (``0`` = ``cuda:0``).
        dynamic_shapes: passed to ``torch.onnx.export`` (the TorchScript
            exporter gets the same dimensions as ``dynamic_axes``).
        exporter: ``"auto"`` (dynamo, then TorchScript if dynamo fails),
            ``"dynamo"`` or ``"torchscript"``. The TorchScript exporter *traces*:
            data-dependent branches are fixed to the path the example inputs take
            (its warnings are logged).
        training: export in train mode (see above).
        output_names: names for the graph outputs, in order. By default a module that
            returns a dict or a Hugging Face ``ModelOutput`` names them by its keys
            (``last_hidden_state``, ``pooler_output``, ``logits``; nested parts joined by
            dots) and other outputs keep the exporter's names.

    Raises:
        ExportError: the exporter failed (with ``"auto"``: both did; the message
            quotes both causes) and says what to try; ``output_names`` of the wrong
            count, repeated, or already naming another blob.
    """
    import torch

    dev = Device.parse(device)
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    if exporter not in _EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose one of {', '.join(_EXPORTERS)}")
    if not isinstance(args, tuple):
        args = tuple(args) if isinstance(args, list) else (args,)
    name = type(module).__name__
    ir_model, used = _export(module, args, kwargs, dynamic_shapes, exporter, name, bool(training))
    _fold_shape_arithmetic(ir_model)
    ir_model.metadata_props[EXPORTER_KEY] = used
    _mark_exporter_constants(ir_model, module)
    _mark_mode(ir_model, module, bool(training))
    if output_names is not None:
        rename_outputs(ir_model, [str(n) for n in output_names], required=True)
    from placement.graph.loading import load

    model = load(ir_model, device=dev)
    log.info("imported %s with the %s exporter: %d ops on %s", name, used, model.graph.num_nodes(), dev)
    return model


def _export(
    module: Any,
    args: tuple,
    kwargs: Mapping[str, Any] | None,
    dynamic_shapes: Any,
    exporter: str,
    name: str,
    training: bool = False,
    skip_settings: frozenset[str] = frozenset(),
) -> tuple[Any, str]:
    """(the exported onnx_ir model, the exporter used), or ExportError quoting each cause."""
    causes: list[str] = []
    ir_model = None
    used = ""
    if exporter in ("auto", "dynamo"):
        try:
            with exportable_settings(module, "dynamo", skip=skip_settings):
                ir_model = _export_dynamo(module, args, kwargs, dynamic_shapes, training)
            used = "dynamo"
        except Exception as err:  # the exporter raises many types
            causes.append(f"dynamo exporter: {_cause(err)}{_version_hint(err)}")
            if exporter == "dynamo":
                raise ExportError(f"torch.onnx.export failed on {name}: {causes[0]}; {_HINT}") from err
            log.warning(
                "the dynamo exporter failed on %s (%s%s); trying the TorchScript exporter",
                name,
                _cause(err),
                _version_hint(err),
            )
    if ir_model is None:
        try:
            with exportable_settings(module, "torchscript", skip=skip_settings):
                ir_model = _export_torchscript(module, args, kwargs, dynamic_shapes, training)
            used = "torchscript"
        except Exception as err:  # the exporter raises many types
            causes.append(f"TorchScript exporter: {_cause(err)}")
            raise ExportError(f"torch.onnx.export failed on {name}: {'; '.join(causes)}; {_HINT}") from err
    return ir_model, used


def exporter_of(model: Model) -> str | None:
    """The exporter that produced ``model`` (``"dynamo"``, ``"torchscript"``), None if not imported.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> exporter_of(pl.from_torch(torch.nn.ReLU(), (torch.randn(2),)))
        'dynamo'
    """
    return model.ir_model.metadata_props.get(EXPORTER_KEY)


def exporter_constants(model: Any) -> frozenset[str]:
    """Initializers that are not the module's state (see :data:`CONSTANTS_KEY`).

    ``model`` is a :class:`~placement.graph.model.Model` or an ``onnx_ir.Model``;
    models not imported by :func:`from_torch` have none.

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Conv2d(3, 4, 3, bias=False)
        >>> model = pl.from_torch(net, (torch.randn(1, 3, 8, 8),))
        >>> [name for name in model.parameters if name not in exporter_constants(model)]
        ['weight']
    """
    import json

    ir_model = getattr(model, "ir_model", model)
    text = ir_model.metadata_props.get(CONSTANTS_KEY)
    if not text:
        return frozenset()
    try:
        names = json.loads(text)
    except ValueError:
        log.warning("ignoring a malformed %s annotation", CONSTANTS_KEY)
        return frozenset()
    return frozenset(str(n) for n in names) if isinstance(names, list) else frozenset()


def _mark_exporter_constants(ir_model: Any, module: Any) -> None:
    """Record the initializers that are not in ``module``'s state_dict (see :data:`CONSTANTS_KEY`)."""
    import json

    state = set(module.state_dict(keep_vars=True))  # parameters and persistent buffers, tied ones too
    made = sorted(name for name in ir_model.graph.initializers if name not in state)
    if made:
        ir_model.metadata_props[CONSTANTS_KEY] = json.dumps(made)
        log.debug("exporter-made constants (not trainable): %s", ", ".join(made))


_MODE_LAYERS = re.compile(r"Dropout|BatchNorm|SyncBatchNorm")


def mode_modules(model: Any) -> list[str]:
    """The layer types of the exported module that behave differently in training (recorded by
    an eval-mode export: they run in eval mode in the lowered module).

    Example:
        >>> import torch
        >>> import placement as pl
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
        >>> mode_modules(pl.from_torch(net, (torch.randn(2, 4),)))
        ['Dropout']
        >>> mode_modules(pl.from_torch(net, (torch.randn(2, 4),), training=True))
        []
    """
    import json

    ir_model = getattr(model, "ir_model", model)
    try:
        names = json.loads(ir_model.metadata_props.get(MODE_MODULES_KEY) or "[]")
    except ValueError:
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def _mark_mode(ir_model: Any, module: Any, training: bool) -> None:
    import json

    import torch

    if training:
        ir_model.metadata_props[TRAINING_KEY] = "1"
        counters = {
            name: int(m.num_batches_tracked)
            for name, m in module.named_modules()
            if isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor) and name
        }
        if counters:
            ir_model.metadata_props[COUNTERS_KEY] = json.dumps(counters)
        cumulative = [name for name in counters if getattr(module.get_submodule(name), "momentum", 0) is None]
        if cumulative:
            ir_model.metadata_props[CUMULATIVE_KEY] = json.dumps(cumulative)
        return
    layers = sorted({type(m).__name__ for m in module.modules() if _MODE_LAYERS.search(type(m).__name__)})
    if layers:
        ir_model.metadata_props[MODE_MODULES_KEY] = json.dumps(layers)


def _cause(err: BaseException) -> str:
    """The most specific first line of an exporter error (the innermost cause)."""
    inner = err
    seen = {id(inner)}
    while inner.__cause__ is not None and id(inner.__cause__) not in seen:
        inner = inner.__cause__
        seen.add(id(inner))
    for candidate in (inner, err):
        text = _ANSI.sub("", str(candidate)).strip()
        if text:
            return f"{type(candidate).__name__}: {text.splitlines()[0]}"
    return type(err).__name__


def _version_hint(err: BaseException) -> str:
    """Where the exporter failed importing onnxscript (a release too old for this torch): what to do.

    Example:
        >>> "pip install -U onnxscript" in _version_hint(ModuleNotFoundError(name="onnxscript._x"))
        True
    """
    inner: BaseException | None = err
    while inner is not None and not isinstance(inner, ImportError):
        inner = inner.__cause__ or inner.__context__
    if inner is None or not (inner.name or "").startswith("onnxscript"):
        return ""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = f"onnxscript {version('onnxscript')}, torch {version('torch')}"
    except PackageNotFoundError:
        have = "onnxscript missing"
    return f" ({have}: this torch's exporter needs a newer onnxscript: pip install -U onnxscript)"


def _export_dynamo(
    module: Any, args: tuple, kwargs: Mapping[str, Any] | None, dynamic_shapes: Any, training: bool = False
) -> Any:
    import torch

    with _eval_mode(module, training=training), _quiet_exporter():
        program = torch.onnx.export(
            module,
            args,
            kwargs=dict(kwargs) if kwargs else None,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            custom_translation_table=translation_table(),
            optimize=False,
            verbose=False,
        )
    ir_model = program.model
    names = structure_names(getattr(getattr(program, "exported_program", None), "call_spec", None))
    if names is not None:
        rename_outputs(ir_model, names, required=False)
    for node in ir_model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        scope = _without_artefacts(scope_from_torch_name_scopes(scopes) or "") if scopes else ""
        expert = node.metadata_props.get(EXPERT_KEY)
        if expert is not None:  # one expert's ops of a grouped matmul (export_rules.grouped_mm)
            scope = f"{scope}.{expert}" if scope else expert
        node.metadata_props[SCOPE_KEY] = scope
    return ir_model


#: Module-path parts the exporter makes up for ops no module produced (torch.export's
#: metadata hook marks them with this placeholder module).
_ARTEFACT_SCOPES = frozenset({"_empty_nn_module_stack_from_metadata_hook"})


def _without_artefacts(scope: str) -> str:
    """``scope`` without the exporter's placeholder module names.

    Example:
        >>> _without_artefacts("_empty_nn_module_stack_from_metadata_hook"), _without_artefacts("enc.0")
        ('', 'enc.0')
    """
    return ".".join(p for p in scope.split(".") if p not in _ARTEFACT_SCOPES) if scope else scope


def _export_torchscript(
    module: Any, args: tuple, kwargs: Mapping[str, Any] | None, dynamic_shapes: Any, training: bool = False
) -> Any:
    """The TorchScript exporter: parameters keep their names (no constant folding, no
    initializers as inputs), inputs are named after ``forward``'s parameters and op
    scopes come from node names (``/encoder/block.0/Add_1`` -> ``encoder.block.0``)."""
    import inspect

    import onnx
    import onnx_ir as ir
    import torch

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][
        : len(args)
    ]
    var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    if var is not None and len(positional) < len(args):  # forward(*args): args_0, args_1, ...
        positional += [f"{var}_{i}" for i in range(len(args) - len(positional))]
    names = positional + list(kwargs or {}) if len(positional) == len(args) else None
    if dynamic_shapes is not None and names is None:
        log.warning(
            "TorchScript exporter: cannot name %s's inputs from its forward signature, so "
            "dynamic_shapes is ignored and every dimension is static",
            type(module).__name__,
        )
    buffer = io.BytesIO()
    with _eval_mode(module, training=training), _quiet_exporter(keep_warnings=True) as caught:
        torch.onnx.export(
            module,
            args,
            buffer,
            kwargs=dict(kwargs) if kwargs else None,
            dynamo=False,
            input_names=names,
            dynamic_axes=_dynamic_axes(dynamic_shapes, names),
            do_constant_folding=False,
            keep_initializers_as_inputs=False,
            opset_version=18,
            training=torch.onnx.TrainingMode.PRESERVE if training else torch.onnx.TrainingMode.EVAL,
        )
    for message in dict.fromkeys(
        str(w.message).splitlines()[0] for w in caught if "Trace" in w.category.__name__
    ):
        log.warning("TorchScript exporter: %s", message)
    ir_model = ir.serde.deserialize_model(onnx.load_from_string(buffer.getvalue()))
    modules = {qualified for qualified, _ in module.named_modules() if qualified}
    for node in ir_model.graph:
        node.metadata_props[SCOPE_KEY] = scope_from_node_name(node.name or "", modules)
    return ir_model


def scope_from_node_name(name: str, modules: Collection[str] = ()) -> str:
    """Module path from a TorchScript-exporter node name.

    Each ``/``-separated part but the last (the op) names a module. A part may be
    relative to the module above it (``encoder`` then ``block.0``) or repeat that
    module's own path (a ``Sequential`` named ``dec`` calls ``dec.0``); with the
    module's qualified names (``modules``) the right reading is chosen.

    Example:
        >>> scope_from_node_name("/encoder/block.0/layer.0/SelfAttention/q/MatMul")
        'encoder.block.0.layer.0.SelfAttention.q'
        >>> scope_from_node_name("/dec/dec.0/Gemm", {"dec", "dec.0"})
        'dec.0'
        >>> scope_from_node_name("/layer1.0/relu_1/Relu", {"layer1.0", "layer1.0.relu"})
        'layer1.0.relu'
        >>> scope_from_node_name("/Add_1")
        ''
    """
    scope = ""
    for part in [p for p in name.split("/") if p][:-1]:
        # A module called again gets a suffix (``relu_1``).
        parts = [part, *([_CALL_SUFFIX.sub("", part)] if _CALL_SUFFIX.search(part) else [])]
        candidates = []
        base = scope
        while True:
            candidates += [f"{base}.{p}" if base else p for p in parts]
            if not base:
                break
            base = base.rpartition(".")[0]
        scope = next((c for c in candidates if c in modules), candidates[0])
    return scope


def _dynamic_axes(dynamic_shapes: Any, names: list[str] | None) -> dict[str, list[int]] | None:
    """``dynamic_shapes`` (per input: a dict of dims, or None) as ``dynamic_axes``."""
    if dynamic_shapes is None or names is None:
        return None
    if isinstance(dynamic_shapes, Mapping):
        items: Any = dynamic_shapes.items()
    else:  # per forward parameter; a ``*args`` parameter's entry is a tuple, one per argument
        flat: list[Any] = []
        for spec in dynamic_shapes:
            flat.extend(spec if isinstance(spec, (tuple, list)) else [spec])
        items = zip(names, flat)
    axes = {str(k): sorted(int(d) for d in dims) for k, dims in items if isinstance(dims, Mapping) and dims}
    return axes or None


def _fold_shape_arithmetic(ir_model: Any) -> None:
    """Fold constant (shape) arithmetic, but never an op that reads a parameter.

    The exporter's default optimizer also folds parameters (BatchNorm into Conv,
    pre-transposed Linear weights), which renames or duplicates them; we keep
    every parameter under its module name instead, and let ONNX Runtime fuse at
    session creation. ONNX shape inference then fills the shapes the exporter
    left out, so reports and planners know every blob's size.
    """
    from onnx_ir.passes.common import RemoveUnusedNodesPass
    from onnxscript.optimizer import fold_constants

    params = set(ir_model.graph.initializers)

    def should_fold(node: Any) -> bool | None:
        if any(v is not None and v.name in params for v in node.inputs):
            return False
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fold_constants(ir_model, should_fold=should_fold)
    _drop_malformed_zero_biases(ir_model)
    RemoveUnusedNodesPass()(ir_model)
    try:  # fill the shapes the exporter left out (sizes in reports, planners)
        infer_types(ir_model, strict=True)
    except Exception as err:  # inference is a convenience; never fail an import over it
        log.debug("ONNX shape inference failed: %s", err)


def _drop_malformed_zero_biases(ir_model: Any) -> None:
    """Drop the all-zero bias of a ``Conv`` whose bias is not the 1-D ``[C_out]`` ONNX needs.

    onnxscript's ``aten_conv3d`` builds the zero bias of a bias-less ``Conv3d`` as
    ``Expand(0, Concat(C_out, [2]))``, shape ``[C_out, 2]``; the exporter's optimizer removes
    it in a default export, but ``from_torch`` exports without it, and ONNX Runtime refuses the
    shape. A zero bias adds nothing, so the ``Conv`` loses it (the ops that built it are then
    unused and removed). Any other bias, right or wrong, is left for the checks downstream.
    """
    import numpy as np

    for graph in ir_model.graphs():
        for node in graph:
            if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
                continue
            bias = node.inputs[2]
            tensor = None if bias is None else _const_tensor(bias)
            if tensor is None or len(tensor.shape) == 1:
                continue
            if not np.any(tensor.numpy()):
                log.debug("%s: dropped its all-zero bias of shape %s", node.name, list(tensor.shape))
                node.resize_inputs(2)


def _const_tensor(value: Any) -> Any:
    """The constant tensor of ``value`` (an initializer or a ``Constant``'s output), else ``None``."""
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].as_tensor()
    return None


@contextlib.contextmanager
def _eval_mode(module: Any, *, training: bool = False) -> Iterator[None]:
    """The module in eval mode (train mode with ``training``), its flags restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def _quiet_exporter(*, keep_warnings: bool = False) -> Iterator[list[Any]]:
    """Silence the exporter's progress prints and warnings (they go to debug logging);
    yields the caught warnings when ``keep_warnings``."""
    names = ["torch.onnx", "torch.export", "torch._dynamo", "onnxscript"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with (
            warnings.catch_warnings(record=keep_warnings) as caught,
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("always" if keep_warnings else "ignore")
            yield caught if caught is not None else []
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if sink.getvalue():
            log.debug("exporter output:\n%s", sink.getvalue())
