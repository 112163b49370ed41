"""How a stage becomes an ONNX Runtime session: options, providers, weights.

:func:`stage_session` builds the session of one stage exactly as
:class:`placement.Runner` does (:func:`stage_options`, the stage's execution
provider, weights handed over as ``OrtValue`` s instead of through a protobuf);
:mod:`placement.runtime.calibrate`, the distributed ranks and
:mod:`placement.runtime.boundaries` build theirs the same way.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> from placement.runtime.stages import partition
    >>> (stage,) = partition(pl.from_torch(*mlp.build("tiny")))
    >>> stage_session(stage, PhysicalDevice("cpu")).get_outputs()[0].name
    'linear_2'
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnxruntime as ort

from placement.errors import PlacementError
from placement.graph.session import ort_session
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.layout import batchnorm_as_conv
from placement.runtime.stages import Stage

__all__ = ["ort_log_severity", "session_from_ir", "session_options", "stage_options", "stage_session"]

#: An optimised graph written by :func:`stage_session` keeps weights of this many bytes or more
#: in a side file.
_EXTERNAL_MIN_BYTES = 1024


def ort_log_severity() -> int:
    """ONNX Runtime's log severity for stage sessions, from the ``placement`` logger's level.

    Errors only (3) by default, so sessions do not print ONNX Runtime's warnings;
    with the ``placement`` logger at INFO (the CLI's ``-v``) warnings too (2), and
    at DEBUG (``-vv``) ONNX Runtime's info messages (1).

    Example:
        >>> ort_log_severity()
        3
    """
    logger = logging.getLogger("placement")
    if logger.isEnabledFor(logging.DEBUG):
        return 1
    if logger.isEnabledFor(logging.INFO):
        return 2
    return 3


def session_options(physical: PhysicalDevice, *, threads: int | None = None) -> ort.SessionOptions:
    """The ``SessionOptions`` every session here starts from (a stage session's are
    :func:`stage_options`; the runtime benchmark's single session uses these as they are).

    Full graph optimisation (``ORT_ENABLE_ALL``), sequential execution, ``threads``
    intra-op threads (default: ONNX Runtime's choice, one per physical core), ONNX
    Runtime's logging at error level unless the ``placement`` logger asks for more
    (:func:`ort_log_severity`), and
    ``session.force_spinning_stop``: a stage's worker threads spin while it runs
    (fast) but stop spinning when its run ends, so a finished stage does not keep
    cores busy while the next stage runs. (A process-wide shared thread pool,
    ``use_per_session_threads = False``, would also do, but it forces every other
    session in the process to use the global pool, so a library cannot choose it.)

    Example:
        >>> opts = session_options(PhysicalDevice("cpu"))
        >>> opts.get_session_config_entry("session.force_spinning_stop")
        '1'
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = ort_log_severity()
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def stage_options(physical: PhysicalDevice, *, threads: int | None = None) -> ort.SessionOptions:
    """The ``SessionOptions`` of a stage session: :func:`session_options`, and on the CPU
    no memory pattern.

    With a memory pattern (ONNX Runtime's default) a session plans one block for its
    intermediate values, but allocates its graph *outputs* outside that block. A whole
    model has few outputs; a stage's outputs are the activations that cross to the
    next stage, and each run wrote them into arena memory that the run had not
    touched (cold in the caches). Without the pattern, every value comes from the
    arena as the run goes, so a stage's output lands in a chunk freed moments
    before. Measured on this project's bench models placed on two emulated devices
    (alternating blocks of runs, 1 thread): resnet 1.030 -> 1.024 and gpt 1.013 ->
    1.004 times the single session, while the single session itself runs the same
    with or without the pattern (1.002, 1.000). GPU sessions keep the pattern.

    Example:
        >>> stage_options(PhysicalDevice("cpu")).enable_mem_pattern
        False
        >>> stage_options(PhysicalDevice("cuda", 0)).enable_mem_pattern
        True
    """
    options = session_options(physical, threads=threads)
    if not physical.is_cuda:
        options.enable_mem_pattern = False
    return options


def stage_session(
    stage: Stage,
    physical: PhysicalDevice,
    *,
    threads: int | None = None,
    optimized_path: Path | None = None,
) -> ort.InferenceSession:
    """The ``InferenceSession`` of one stage on ``physical`` (as :class:`Runner` builds it).

    Options from :func:`stage_options`; the CUDA provider with the GPU's
    ``device_id`` (CPU as fallback for ops it lacks), or the CPU provider (whose
    session runs a BatchNormalization cut from its Conv as a depthwise Conv, see
    :mod:`placement.runtime.layout`). With ``optimized_path``, ONNX Runtime also
    writes the graph it optimised there, weights of a kilobyte or more beside it in
    ``<name>.weights`` (see :mod:`placement.runtime.boundaries`).

    Raises:
        PlacementError: ONNX Runtime cannot build the session (names the stage, its
            devices and first op).

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> from placement.runtime.stages import partition
        >>> (stage,) = partition(pl.from_torch(*mlp.build("tiny")))
        >>> [i.name for i in stage_session(stage, PhysicalDevice("cpu")).get_inputs()]
        ['input']
    """
    options = stage_options(physical, threads=threads)
    options.logid = f"stage{stage.index}-{stage.device.slug}"
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", f"{optimized_path.stem}.weights"
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(_EXTERNAL_MIN_BYTES)
        )
    providers: list[Any] = [physical.ort_provider]
    if physical.is_cuda:
        providers.append("CPUExecutionProvider")
    try:
        model = stage.model if physical.is_cuda else batchnorm_as_conv(stage.model)
        return session_from_ir(model, options, providers)
    except Exception as err:  # ORT raises several types (Fail, InvalidGraph, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlacementError(
            f"cannot build the ONNX Runtime session of stage {stage.index} "
            f"({stage.device} -> {physical}, {len(stage.ops)} ops starting with "
            f"{stage.ops[0]!r}): {first}"
        ) from err


def session_from_ir(model: Any, options: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
    """An ``InferenceSession`` of an ``onnx_ir`` model whose weights bypass the protobuf
    (:func:`placement.graph.session.ort_session`, which every session here goes through).
    """
    return ort_session(model, options, providers)
