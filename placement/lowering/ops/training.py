"""Ops whose behaviour follows the module's train/eval mode: ``Dropout`` and ``BatchNormalization``.

A model exported for training (``pl.from_torch(net, args, training=True)``, which records
:data:`~placement.graph.torch_import.TRAINING_KEY`) keeps its ``Dropout`` ops, and its
``BatchNormalization`` ops stand for batch statistics. The lowering then emits each as a call
of a small stateless submodule (:class:`ModeDropout`, :class:`ModeBatchNorm`) that reads
``self.training``, so ``module.train()`` and ``module.eval()`` switch them as they switch
``torch.nn.Dropout`` and ``torch.nn.BatchNorm2d``: in train mode Dropout zeroes elements with
probability ``p`` and scales the rest by ``1 / (1 - p)``, and BatchNorm normalises with the
batch's statistics and updates the running buffers in place (the lowered module's buffers,
under the module's own names, which ``model.update_parameters(module)`` writes back); in eval
mode both are what an inference graph computes.

Recomputation (a checkpointed pipeline stage running its forward again in backward) happens
inside :func:`replaying`: Dropout draws the same masks from a generator seeded for that
(stage, micro-batch), and BatchNorm normalises with the same batch statistics without
updating the running buffers a second time.

Example:
    >>> import torch
    >>> drop = ModeDropout(0.5)
    >>> x = torch.ones(1000)
    >>> bool((drop(x) == 0).any()), bool((drop.eval()(x) == x).all())
    (True, True)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import onnx_ir as ir
import torch
import torch.nn.functional as F

from placement.errors import LoweringError
from placement.graph.nodes import SCOPE_KEY
from placement.graph.torch_import import COUNTERS_KEY, CUMULATIVE_KEY, TRAINING_KEY

__all__ = [
    "MODE_OP_TYPES",
    "ModeBatchNorm",
    "ModeDropout",
    "emit_mode_op",
    "is_training_export",
    "mode_op_names",
    "replaying",
]

#: ONNX op types that follow train/eval mode in a model exported for training.
MODE_OP_TYPES = frozenset({"Dropout", "BatchNormalization"})

_LOCAL = threading.local()


def is_training_export(model: Any) -> bool:
    """Whether ``model`` (a ``placement.Model`` or ``onnx_ir.Model``) was exported for training."""
    ir_model = getattr(model, "ir_model", model)
    return ir_model.metadata_props.get(TRAINING_KEY) == "1"


def mode_op_names(model: Any) -> set[str]:
    """Names of the ops lowered as train/eval-mode modules (none unless exported for training)."""
    if not is_training_export(model):
        return set()
    graph = getattr(model, "graph", None) or model.ir_model.graph
    return {
        node.name or "" for node in graph if node.op_type in MODE_OP_TYPES and node.domain in ("", "ai.onnx")
    }


@contextlib.contextmanager
def replaying(seed: int, *, recompute: bool) -> Iterator[None]:
    """Run a stage's forward with Dropout masks drawn from generators seeded by ``seed`` (one per
    device, on this thread only); ``recompute``: BatchNorm leaves its running buffers alone."""
    saved = getattr(_LOCAL, "state", None)
    _LOCAL.state = (seed, {}, recompute)
    try:
        yield
    finally:
        _LOCAL.state = saved


def _generator(device: torch.device) -> torch.Generator | None:
    state = getattr(_LOCAL, "state", None)
    if state is None:
        return None
    seed, generators, _ = state
    key = str(device)
    if key not in generators:
        generators[key] = torch.Generator(device=device)
        generators[key].manual_seed(seed)
    return generators[key]


def _recomputing() -> bool:
    state = getattr(_LOCAL, "state", None)
    return bool(state and state[2])


class ModeDropout(torch.nn.Module):
    """ONNX ``Dropout`` of a training export: live in train mode, the identity in eval mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        noise = torch.rand(x.shape, generator=_generator(x.device), device=x.device)
        return x * (noise >= self.p).to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ModeBatchNorm(torch.nn.Module):
    """ONNX ``BatchNormalization`` of a training export: batch statistics and running-buffer
    updates in train mode (``momentum`` in torch's convention; ``None``: the cumulative moving
    average ``1 / num_batches_tracked``, as ``torch.nn.BatchNorm2d(momentum=None)``), running
    statistics in eval mode."""

    def __init__(self, momentum: float | None, eps: float) -> None:
        super().__init__()
        self.momentum = None if momentum is None else float(momentum)
        self.eps = float(eps)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        num_batches_tracked: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, self.eps)
        if _recomputing():  # the same batch statistics, the buffers already updated once
            return F.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
        factor = self.momentum
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
            if factor is None:  # as torch's BatchNorm: reads the count on the host
                factor = 1.0 / float(num_batches_tracked)
        if factor is None:
            raise RuntimeError("a cumulative-average BatchNorm needs its num_batches_tracked buffer")
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, factor, self.eps)

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}, eps={self.eps}"


def emit_mode_op(lowering: Any, node: ir.Node, ins: list[Any], phys: str) -> bool:
    """Lower a ``Dropout`` or ``BatchNormalization`` of a training export as a call of its
    mode module (see the module docstring); False (the ordinary rule) anywhere else."""
    if not is_training_export(lowering.model) or not _only_first_output_used(lowering, node):
        return False
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    cumulative = False
    name = node.outputs[0].name or node.op_type.lower()
    if node.op_type == "Dropout":
        ratio = lowering.constant(ins[1]) if len(ins) > 1 else None
        training = lowering.constant(ins[2]) if len(ins) > 2 else None
        if training is None or not bool(training) or (len(ins) > 1 and ins[1] is not None and ratio is None):
            return False
        module: torch.nn.Module = ModeDropout(0.5 if ratio is None else float(ratio))
        args = [ins[0]]
    else:
        if len(ins) != 5 or any(v is None for v in ins):
            return False
        cumulative = _cumulative(lowering, node)
        momentum = None if cumulative else 1.0 - float(attrs.get("momentum", 0.9))
        module = ModeBatchNorm(momentum, float(attrs.get("epsilon", 1e-5)))
        args = ins
    path = lowering.add_module(f"{name}_{node.op_type.lower()}", module)
    nodes = [lowering.on(v, phys) for v in args]
    counter = _counter(lowering, node, phys) if node.op_type == "BatchNormalization" else None
    if counter is not None:
        nodes.append(counter)
    elif node.op_type == "BatchNormalization" and cumulative:
        raise LoweringError(
            f"BatchNormalization {node.name!r}: a cumulative-average BatchNorm (momentum=None) "
            "needs the exporter's num_batches_tracked record"
        )
    call = lowering.emit("call_module", path, tuple(nodes), {}, name)
    lowering.define(name, call, lowering.current_device)
    return True


def _only_first_output_used(lowering: Any, node: ir.Node) -> bool:
    """Whether the node's outputs past the first (a training BatchNorm's running statistics, as
    the TorchScript exporter writes them) are absent or unused: the mode module updates the
    running buffers in place instead."""
    graph_outputs = {id(v) for v in lowering.model.ir_model.graph.outputs}
    return node.outputs[0] is not None and all(
        o is None or (not o.uses() and id(o) not in graph_outputs) for o in node.outputs[1:]
    )


def _cumulative(lowering: Any, node: ir.Node) -> bool:
    """Whether the exporter recorded the node's BatchNorm module with ``momentum=None``."""
    import json

    scope = node.metadata_props.get(SCOPE_KEY, "")
    try:
        cumulative = json.loads(lowering.model.ir_model.metadata_props.get(CUMULATIVE_KEY) or "[]")
    except ValueError:
        return False
    return bool(scope) and scope in cumulative


def _counter(lowering: Any, node: ir.Node, phys: str) -> Any:
    """The get_attr node of the BatchNorm's ``num_batches_tracked`` buffer, registered under the
    module's name (``layer1.0.bn1.num_batches_tracked``) with the exported module's count, so the
    lowered module's ``state_dict`` loads into the network strictly; None without a record."""
    import json

    scope = node.metadata_props.get(SCOPE_KEY, "")
    try:
        counters = json.loads(lowering.model.ir_model.metadata_props.get(COUNTERS_KEY) or "{}")
    except ValueError:
        return None
    if not scope or scope not in counters:
        return None
    path = f"{scope}.num_batches_tracked"
    if path in lowering.taken_paths or path in lowering.prefixes:  # one BatchNorm called twice
        return lowering.graph.get_attr(path) if path in lowering.taken_paths else None
    if lowering._attr_path(path) != path:
        return None
    lowering._register(
        path, torch.tensor(int(counters[scope]), dtype=torch.long, device=phys), parameter=False
    )
    return lowering.graph.get_attr(path)
