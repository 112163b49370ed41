"""Cross-device copy injection (Caffe2's ``InjectCrossDeviceCopies``), idempotent.

After ops are placed, every edge whose ends sit on different devices must go
through a copy. The pass brings the graph to exactly that state, whatever copies
it already has:

* one copy per (blob, destination device), never two; every consumer on that
  device reads it, consumers on the blob's own device read the blob;
* a copy is an ``Identity`` op on its destination device, marked ``static`` when
  its source is a parameter (runtimes copy it once at load time), ``streamed``
  when that parameter is streamed (it lives in host memory, see
  :func:`placement.stream_parameters`, and runtimes copy it every run, prefetched),
  or ``dynamic``;
  its output blob is ``<blob>_<type>_<index>`` (``fc3_cuda_1``), made unique
  (``fc3_cuda_1_1``) if the name is taken;
* a copy sits just before the first op that reads it, so it joins that op's
  device segment; a copy only a graph output reads goes at the end;
* a ``Loop``/``Scan`` body or ``If`` branch that reads a blob of the enclosing
  graph (an outer-scope read) reads it on its op's device: through a copy made in
  the enclosing graph, before the op, when the blob lives elsewhere;
* graph inputs are fed on the input device, graph outputs are gathered on the
  output device. Names are kept: a consumer of input ``x`` on another device reads
  ``x_cuda_1``; an output ``y`` produced on ``cuda:1`` but wanted on ``cuda:0``
  becomes ``y_cuda_1`` (the blob as it lives on ``cuda:1``) and a copy produces
  ``y`` on ``cuda:0``;
* copies left over from an earlier injection are repaired: redundant ones (same
  device at both ends, duplicates, unused) are removed and their readers rewired,
  chains are shortened to read the original blob, misplaced ones are moved.

Running it twice changes nothing the second time. A parameter lives where its
first reader (graph order) runs, like everywhere in ``placement``; a graph input
or output passed straight through (not produced by an op) is left as it is.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> acts = pl.get_activation_blobs(model)
    >>> _ = pl.shift_activation_devices(model, acts[2:], {0: 1})
    >>> result = pl.inject_cross_device_copies(model, output_device=0)
    >>> [(op.inputs[0], op.outputs[0], str(op.device)) for op in model.ops if op.is_copy]
    [('relu', 'relu_cuda_1', 'cuda:1'), ('linear_2_cuda_1', 'linear_2', 'cuda:0')]
    >>> pl.verify(model)
    >>> pl.inject_cross_device_copies(model, output_device=0).modified
    False
"""

from __future__ import annotations

import logging
from typing import cast

import onnx_ir as ir

from placement.graph.device import Device, DeviceLike
from placement.graph.nodes import DEVICE_KEY
from placement.passes.base import ModelLike, PlacementPass
from placement.passes.copy_injection import CopyInjection
from placement.passes.copy_making import CopyResult
from placement.passes.kv_cache import settle_kv_caches

__all__ = ["inject_cross_device_copies", "InjectCrossDeviceCopiesPass"]

log = logging.getLogger(__name__)


class InjectCrossDeviceCopiesPass(PlacementPass):
    """Insert, repair or remove copies so that every cross-device edge has exactly one.

    Args:
        input_device: device graph inputs are fed on; ``None``: the device of the
            first op that reads a graph input.
        output_device: device graph outputs are gathered on; ``None``: the device of
            the last op (graph order) that produces a graph output.
        debug: run ``verify`` afterwards (default: ``PLACEMENT_DEBUG``).

    ``call`` returns a :class:`CopyResult` and records both devices in the model.
    """

    ensures_verified = True

    def __init__(
        self,
        *,
        input_device: DeviceLike | None = None,
        output_device: DeviceLike | None = None,
        debug: bool | None = None,
        check_onnx: bool = True,
    ) -> None:
        super().__init__(debug=debug, check_onnx=check_onnx)
        self.input_device = Device.parse(input_device) if input_device is not None else None
        self.output_device = Device.parse(output_device) if output_device is not None else None

    def __repr__(self) -> str:
        return (
            f"InjectCrossDeviceCopiesPass(input_device={self.input_device}, "
            f"output_device={self.output_device})"
        )

    def call(self, model: ir.Model) -> CopyResult:
        undo = [(node, node.metadata_props.get(DEVICE_KEY)) for node in model.graph]
        settled = settle_kv_caches(model)  # a KV cache is read on one device (state, not data)
        try:
            result = CopyInjection(model, self.input_device, self.output_device).run()
        except BaseException:
            if settled:
                for node, spec in undo:
                    if spec is not None:
                        node.metadata_props[DEVICE_KEY] = spec
            raise
        if settled:
            result.modified = True
        return result


def inject_cross_device_copies(
    model: ModelLike,
    *,
    input_device: DeviceLike | None = None,
    output_device: DeviceLike | None = None,
) -> CopyResult:
    """Put exactly one copy on every (blob, destination device) edge; idempotent.

    See :mod:`placement.passes.copies` for the rules (names, graph inputs and
    outputs, static copies, repair of earlier copies).

    Args:
        model: the placed model (changed in place).
        input_device: where graph inputs are fed; ``None``: the device of the first
            op reading a graph input.
        output_device: where graph outputs are gathered; ``None``: the device of the
            last op producing a graph output.

    Returns:
        A :class:`CopyResult` (``.modified``, ``.added``, ``.removed``, ``.copies``, ...).

    Raises:
        DeviceError: an op's device or an argument is malformed (model unchanged).
        VerificationError: a copy op is malformed (model unchanged).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> result = pl.inject_cross_device_copies(model, output_device="cpu")
        >>> model.outputs, [op.name for op in model.ops if op.is_copy]
        (['linear_2'], ['copy_linear_2_cpu_0'])
        >>> str(model.output_device), pl.inject_cross_device_copies(model).modified
        ('cpu', True)
    """
    pass_ = InjectCrossDeviceCopiesPass(input_device=input_device, output_device=output_device)
    return cast(CopyResult, pass_(model))
