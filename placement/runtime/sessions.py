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
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from placement.errors import InputError, PlacementError
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.layout import batchnorm_as_conv
from placement.runtime.stages import Stage

__all__ = [
    "check_threads",
    "usable_cores",
    "THREADS_PER_CORE_CAP",
    "ort_log_severity",
    "session_from_ir",
    "session_options",
    "stage_options",
    "stage_session",
]

log = logging.getLogger(__name__)

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


#: Thread counts above this many per usable core are capped (with a warning).
THREADS_PER_CORE_CAP = 4


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else ``os.cpu_count``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_threads(threads: int | None, *, what: str = "threads") -> int | None:
    """A validated intra-op thread count: ``None`` (the runtime's choice) or at least 1.

    A count far above the cores this process may use (more than
    :data:`THREADS_PER_CORE_CAP` per core) only adds threads fighting for them: it is
    capped there with a warning.

    Raises:
        InputError: ``threads`` is not a whole number of at least 1 (names ``what``).

    Example:
        >>> check_threads(None) is None, check_threads(1)
        (True, 1)
        >>> check_threads(-3)
        Traceback (most recent call last):
        ...
        placement.errors.InputError: threads must be a whole number of at least 1, got -3
    """
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise InputError(f"{what} must be a whole number of at least 1, got {threads!r}")
    cap = THREADS_PER_CORE_CAP * usable_cores()
    if threads > cap:
        log.warning("%s=%d is far above the %d usable cores: using %d", what, threads, usable_cores(), cap)
        return cap
    return int(threads)


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
    threads = check_threads(threads)
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
    """An ``InferenceSession`` of an ``onnx_ir`` model whose weights bypass the protobuf.

    The proto holds only the graph (so no 2 GB limit); each large weight is handed
    to ONNX Runtime as an ``OrtValue`` over the model's own array (memory-mapped
    for a model loaded lazily), which the session copies onto its device once.
    """
    from placement.graph.serialize import split_weights

    proto, weights = split_weights(model)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in weights.values()]
    if values:
        options.add_external_initializers(list(weights), values)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=providers)
    session._placement_weights = values  # the session may read them for as long as it lives
    return session
