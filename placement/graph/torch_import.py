"""Import a PyTorch module through ``torch.onnx.export(..., dynamo=True)``.

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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from placement.errors import ExportError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import SCOPE_KEY, Model, scope_from_torch_name_scopes

__all__ = ["from_torch"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
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
) -> Model:
    """Export ``module`` to an operator graph with every op on ``device``.

    The module is exported in eval mode (its training flags are restored
    afterwards, so the module is unchanged). Initializers keep the module's
    parameter names (a parameter shared by two modules, like a tied LM head,
    is one initializer); constant shape arithmetic is folded but parameters
    never are. Each op records the module path that produced it (``op.scope``).

    Args:
        module: a ``torch.nn.Module``.
        args: example positional inputs (a tuple, or a single tensor).
        kwargs: example keyword inputs.
        device: the device every op starts on (``0`` = ``cuda:0``).
        dynamic_shapes: passed to ``torch.onnx.export``.

    Raises:
        ExportError: the exporter failed; the message says what to try.
    """
    import torch

    dev = Device.parse(device)
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        args = tuple(args) if isinstance(args, list) else (args,)
    with _eval_mode(module), _quiet_exporter():
        try:
            program = torch.onnx.export(
                module,
                args,
                kwargs=dict(kwargs) if kwargs else None,
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                optimize=False,
                verbose=False,
            )
        except Exception as err:  # the exporter raises many types
            text = _ANSI.sub("", str(err)).strip()
            first = text.splitlines()[0] if text else type(err).__name__
            raise ExportError(
                f"torch.onnx.export failed on {type(module).__name__}: {first}; {_HINT}"
            ) from err
    ir_model = program.model
    _fold_shape_arithmetic(ir_model)
    for node in ir_model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        node.metadata_props[SCOPE_KEY] = (scope_from_torch_name_scopes(scopes) or "") if scopes else ""
    from placement.graph.serialize import load

    model = load(ir_model, device=dev)
    log.info("imported %s: %d ops on %s", type(module).__name__, model.graph.num_nodes(), dev)
    return model


def _fold_shape_arithmetic(ir_model: Any) -> None:
    """Fold constant (shape) arithmetic, but never an op that reads a parameter.

    The exporter's default optimizer also folds parameters (BatchNorm into Conv,
    pre-transposed Linear weights), which renames or duplicates them; we keep
    every parameter under its module name instead, and let ONNX Runtime fuse at
    session creation. ONNX shape inference then fills the shapes the exporter
    left out, so reports and planners know every blob's size.
    """
    from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
    from onnxscript.optimizer import fold_constants

    params = set(ir_model.graph.initializers)

    def should_fold(node: Any) -> bool | None:
        if any(v is not None and v.name in params for v in node.inputs):
            return False
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fold_constants(ir_model, should_fold=should_fold)
    RemoveUnusedNodesPass()(ir_model)
    try:  # fill the shapes the exporter left out (sizes in reports, planners)
        ShapeInferencePass()(ir_model)
    except Exception as err:  # inference is a convenience; never fail an import over it
        log.debug("ONNX shape inference failed: %s", err)


@contextlib.contextmanager
def _eval_mode(module: Any) -> Iterator[None]:
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's progress prints and warnings (they go to debug logging)."""
    names = ["torch.onnx", "torch.export", "torch._dynamo", "onnxscript"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if sink.getvalue():
            log.debug("exporter output:\n%s", sink.getvalue())
