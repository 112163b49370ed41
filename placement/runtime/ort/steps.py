"""The steps of a compiled ONNX Runtime run: stage sessions and transfers over a value table.

* :class:`StageStep` runs a stage session on ``OrtValue`` s: on the CPU with the
  session's native ``run_with_ort_values`` (one call; the run allocates fresh outputs),
  on a GPU with ``run_with_iobinding`` (outputs bound to, and allocated on, the GPU);
* :class:`HostStep` runs a stage whose boundary carries sequences, optionals or
  string tensors with ``InferenceSession.run`` (which takes and returns them as
  lists, ``None`` and object arrays);
* :class:`TransferStep` moves a blob to another device
  (:func:`placement.runtime.ort.values.transfer_kind` says how).

Each step reads and writes a *value table* (key -> ``OrtValue`` or host value) and drops the
keys whose last reader it is (``free``).

Example:
    >>> import numpy as np
    >>> from placement.runtime.device_map import PhysicalDevice
    >>> step = TransferStep("alias", "a", "b", PhysicalDevice("cpu"), free=("a",))
    >>> values = {"a": np.ones(2)}
    >>> step.run(values)
    >>> list(values)
    ['b']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

from placement.errors import PlacementError
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.values import ALIAS, _host, _host_copy, move, ortvalue
from placement.runtime.stages import Stage

__all__ = ["HostStep", "StageExec", "StageStep", "Step", "TransferStep"]


@dataclass
class StageExec:
    """A stage with its physical device and session (and, once compiled, how it runs).

    Attributes:
        stage, physical, session: the stage, its device and its session.
        binding: the stage's own ``IOBinding`` (stages on a GPU; None on the CPU).
        out_device: where a GPU stage's outputs are allocated.
        direct: for a stage on the CPU, the session's native ``run_with_ort_values``
            (see :meth:`StageStep.call`); None where outputs are bound instead.
    """

    stage: Stage
    physical: PhysicalDevice
    session: ort.InferenceSession
    binding: Any = None
    out_device: tuple[str, int] = ("cpu", 0)
    direct: Any = None

    def new_binding(self, outputs: tuple[str, ...]) -> Any:
        """An ``IOBinding`` of this stage's session with ``outputs`` bound to its device
        (None for a stage that runs without one, see :meth:`StageStep.call`)."""
        if self.direct is not None:
            return None
        binding = self.session.io_binding()
        self.bind_outputs(binding, outputs)
        return binding

    def bind_outputs(self, binding: Any, outputs: tuple[str, ...]) -> None:
        """Bind ``outputs`` of ``binding`` to this stage's device (fresh buffers each run)."""
        device_type, device_id = self.out_device
        for name in outputs:
            binding.bind_output(name, device_type, device_id)

    def error(self, err: Exception) -> PlacementError:
        """ONNX Runtime failed while running this stage: say which stage, device and ops."""
        ops = self.stage.ops
        span = f"op {ops[0]!r}" if len(ops) == 1 else f"ops {ops[0]!r} .. {ops[-1]!r}"
        return PlacementError(
            f"stage {self.stage.index} ({self.stage.device} -> {self.physical}, {span}) "
            f"failed in ONNX Runtime: {_first_line(err)}"
        )


# --- steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageStep:
    """Run a stage session on ``OrtValue`` s (activations stay on the device).

    :meth:`run` is :meth:`inputs`, :meth:`call`, :meth:`store` in turn (separate
    so that ``benchmarks/runtime.py --explain`` can time each).

    Attributes:
        exec: the stage, its device and session.
        bind: (session input name, value-table key) pairs.
        outputs: the stage's outputs (also their value-table keys).
        free: keys whose last reader this step is.
    """

    exec: StageExec
    bind: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    free: tuple[str, ...] = ()

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` (``binding``: an ``IOBinding`` of a GPU stage's session
        to use instead of the stage's own; a pipeline gives each worker its own)."""
        self.store(values, self.call(self.inputs(values), binding))

    def inputs(self, values: dict[str, Any]) -> dict[str, ort.OrtValue]:
        """The session's inputs, read from ``values`` (host tensors from a host-value
        stage become ``OrtValue`` s on the stage's device, in ``values`` too)."""
        physical = self.exec.physical
        feeds = {}
        for name, key in self.bind:
            value = values[key]
            if not isinstance(value, ort.OrtValue):
                value = values[key] = ortvalue(value, physical)
            feeds[name] = value
        return feeds

    def call(self, feeds: dict[str, ort.OrtValue], binding: Any = None) -> list[ort.OrtValue]:
        """Run the session on ``feeds``; the outputs, in fresh buffers on the stage's device.

        A stage on the CPU calls the session's native ``run_with_ort_values``
        (outputs are allocated by the run, one call, none of the Python checks the
        public wrapper repeats each run); a stage on a GPU runs through an
        ``IOBinding`` whose outputs are bound to its device (``run_with_ort_values``
        would hand them back in host memory), cleared and bound again after the run
        so the next run allocates fresh buffers (returned arrays are never overwritten).
        """
        ex = self.exec
        if ex.direct is not None:
            try:
                native = ex.direct({name: v._ortvalue for name, v in feeds.items()}, self.outputs, None)
            except Exception as err:  # ORT raises Fail, InvalidArgument, RuntimeException...
                raise ex.error(err) from err
            return [ort.OrtValue(native[i]) for i in range(len(self.outputs))]
        binding = ex.binding if binding is None else binding
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        try:
            ex.session.run_with_iobinding(binding)
        except Exception as err:
            binding.clear_binding_inputs()
            raise ex.error(err) from err
        outputs = binding.get_outputs()
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        ex.bind_outputs(binding, self.outputs)
        return outputs

    def store(self, values: dict[str, Any], outputs: list[ort.OrtValue]) -> None:
        """Put the outputs into ``values``; drop the keys this step read last."""
        _store(values, self.outputs, outputs, self.free)


@dataclass(frozen=True)
class HostStep:
    """Run a stage on host values (sequences, optionals or strings cross its boundary).

    :meth:`run` is :meth:`inputs`, :meth:`call`, :meth:`store` in turn, as for :class:`StageStep`.
    """

    exec: StageExec
    bind: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    free: tuple[str, ...] = ()

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` with ``InferenceSession.run`` (``binding`` is unused)."""
        self.store(values, self.call(self.inputs(values)))

    def inputs(self, values: dict[str, Any]) -> dict[str, Any]:
        """The session's inputs, read from ``values`` as host values."""
        return {name: _host(values[key]) for name, key in self.bind}

    def call(self, feeds: dict[str, Any], binding: Any = None) -> list[Any]:
        """Run the session on ``feeds``; its outputs as host values."""
        try:
            return self.exec.session.run(list(self.outputs), feeds)
        except Exception as err:  # noqa: BLE001 (re-raised as a PlacementError naming the stage)
            raise self.exec.error(err) from err

    def store(self, values: dict[str, Any], outputs: list[Any]) -> None:
        """Put the outputs into ``values``; drop the keys this step read last."""
        _store(values, self.outputs, outputs, self.free)


@dataclass(frozen=True)
class TransferStep:
    """Move the value at ``source`` to ``physical`` as ``target`` (see :func:`transfer_kind`)."""

    kind: str
    source: str
    target: str
    physical: PhysicalDevice
    free: tuple[str, ...] = ()

    @property
    def moves_data(self) -> bool:
        """False for an alias (both ends share the value)."""
        return self.kind != ALIAS

    def run(self, values: dict[str, Any], binding: Any = None) -> None:
        """Run on ``values`` (``binding`` is unused)."""
        value = values[self.source]
        if not isinstance(value, ort.OrtValue):
            values[self.target] = value if self.kind == ALIAS else _host_copy(value)
        else:
            try:
                values[self.target] = move(value, self.kind, self.physical)
            except PlacementError:
                raise
            except Exception as err:  # an allocation on the destination device failed
                raise PlacementError(
                    f"moving blob {self.source!r} to {self.physical} failed: {_first_line(err)}"
                ) from err
        _drop(values, self.free)


Step = StageStep | HostStep | TransferStep


def _store(values: dict[str, Any], names: tuple[str, ...], results: list[Any], free: tuple[str, ...]) -> None:
    """Put a stage's ``results`` into ``values`` under ``names``, then drop the keys in ``free``."""
    values.update(zip(names, results))
    _drop(values, free)


def _drop(values: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        del values[key]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
