"""How a stage becomes an ONNX Runtime session: options, providers, weights.

:func:`stage_session` builds the session of one stage exactly as
:class:`placement.Runner` does (:func:`stage_options`, the stage's execution
provider, weights handed over as ``OrtValue`` s instead of through a protobuf);
:mod:`placement.runtime.calibrate`, the distributed ranks and
:mod:`placement.runtime.ort.boundaries` build theirs the same way.

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
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from placement.errors import DeviceError, InputError, PlacementError
from placement.graph.session import ort_session
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort.layout import batchnorm_as_conv
from placement.runtime.precision import DEFAULT_PRECISION, ort_cuda_options
from placement.runtime.stages import Stage

__all__ = [
    "THREADS_PER_CORE_CAP",
    "check_providers",
    "check_threads",
    "cuda_provider_error",
    "cuda_provider_options",
    "ort_log_severity",
    "providers",
    "session_from_ir",
    "session_options",
    "shared_cuda_allocator",
    "usable_cores",
    "stage_options",
    "stage_session",
]

log = logging.getLogger(__name__)

#: Environment variable: a byte limit for the CUDA memory of the sessions of one GPU
#: (``gpu_mem_limit`` of ONNX Runtime's CUDA provider and of the shared arena).
GPU_MEM_LIMIT_ENV = "PLACEMENT_GPU_MEM_LIMIT"

_shared_allocators: dict[int, bool] = {}
_allocator_lock = threading.Lock()

#: An optimised graph written by :func:`stage_session` keeps weights of this many bytes or more
#: in a side file.
_EXTERNAL_MIN_BYTES = 1024


def ort_log_severity() -> int:
    """ONNX Runtime's log severity for stage sessions, from the ``placement`` logger's level.

    Fatal only (4) by default: ONNX Runtime's own log lines (colour-coded, written
    straight to stderr) stay off, since every error it reports reaches the caller as
    a :class:`placement.PlacementError` carrying its message, and the command line
    promises one-line errors. Asked for, they show: with the ``placement`` logger at
    INFO (the CLI's ``-v``) ONNX Runtime's errors and warnings (2), at DEBUG (``-vv``)
    its info messages too (1).

    Example:
        >>> ort_log_severity()
        4
    """
    logger = logging.getLogger("placement")
    if logger.isEnabledFor(logging.DEBUG):
        return 1
    if logger.isEnabledFor(logging.INFO):
        return 2
    return 4


def providers(physical: PhysicalDevice, *, precision: str = DEFAULT_PRECISION) -> list[Any]:
    """The execution providers of a session on ``physical``: the CUDA provider with the GPU's
    ``device_id`` and ``use_tf32`` for ``precision`` (see :mod:`placement.runtime.precision`),
    the CPU provider as fallback for ops it lacks; or the CPU provider alone.

    Before a CUDA session is built, ONNX Runtime's default logger is set to
    :func:`ort_log_severity` (off unless the ``placement`` logger asks for it):
    since 1.26, building a CUDA session with a ``device_id`` logs a warning through that
    logger ("No registered plugin EP device found") that says nothing to a user.

    Example:
        >>> providers(PhysicalDevice("cpu"))
        [('CPUExecutionProvider', {})]
    """
    if not physical.is_cuda:
        return [physical.ort_provider]
    ort.set_default_logger_severity(ort_log_severity())
    return [
        ("CUDAExecutionProvider", {**cuda_provider_options(physical), **ort_cuda_options(precision)}),
        "CPUExecutionProvider",
    ]


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
    Runtime's own log off unless the ``placement`` logger asks for it
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


def cuda_provider_options(physical: PhysicalDevice) -> dict[str, str]:
    """The CUDA execution provider's options of a session on ``physical`` (a GPU).

    * ``device_id``: the GPU.
    * ``arena_extend_strategy=kSameAsRequested``: an arena grows by what is asked for,
      not by doubling (``kNextPowerOfTwo``, the default), so several sessions on one GPU
      (the stages, and any other session in the process) do not each hold up to twice
      their peak.
    * ``gpu_mem_limit``: from the ``PLACEMENT_GPU_MEM_LIMIT`` environment variable (bytes)
      when set.
    * ``do_copy_in_default_stream=1`` (ONNX Runtime's default and recommendation: copies
      on the compute stream, no race between a copy and the kernels reading it).
    * ``cudnn_conv_algo_search=EXHAUSTIVE`` (the default, said explicitly: the fastest
      convolution algorithms, searched once per input shape).

    Example:
        >>> cuda_provider_options(PhysicalDevice("cuda", 1))["arena_extend_strategy"]
        'kSameAsRequested'
    """
    options = {
        "device_id": str(physical.index),
        "arena_extend_strategy": "kSameAsRequested",
        "do_copy_in_default_stream": "1",
        "cudnn_conv_algo_search": "EXHAUSTIVE",
    }
    limit = os.environ.get(GPU_MEM_LIMIT_ENV)
    if limit:
        options["gpu_mem_limit"] = str(int(limit))
    return options


def shared_cuda_allocator(physical: PhysicalDevice) -> bool:
    """Register, once per process and GPU, one CUDA arena that every stage session on that
    GPU allocates from (``onnxruntime.create_and_register_allocator_v2`` and the session
    option ``session.use_env_allocators``): stages of one GPU then share one arena instead
    of each growing its own, so a placed model holds about what one session holds.

    Returns whether the shared arena is registered; False (logged once) where this
    onnxruntime build cannot register a CUDA allocator, and sessions keep their own.
    """
    with _allocator_lock:
        done = _shared_allocators.get(physical.index)
        if done is not None:
            return done
        try:
            info = ort.OrtMemoryInfo(
                "Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, physical.index, ort.OrtMemType.DEFAULT
            )
            arena = {"arena_extend_strategy": 1}  # kSameAsRequested
            limit = os.environ.get(GPU_MEM_LIMIT_ENV)
            if limit:
                arena["max_mem"] = int(limit)
            provider = {k: v for k, v in cuda_provider_options(physical).items() if k != "gpu_mem_limit"}
            ort.create_and_register_allocator_v2(
                "CUDAExecutionProvider", info, provider, ort.OrtArenaCfg(arena)
            )
            ok = True
        except Exception as err:  # noqa: BLE001 (an older or CPU-only build: per-session arenas)
            log.info(
                "cannot register a shared CUDA arena for %s (%s); each session keeps its own", physical, err
            )
            ok = False
        _shared_allocators[physical.index] = ok
        return ok


def stage_session(
    stage: Stage,
    physical: PhysicalDevice,
    *,
    threads: int | None = None,
    optimized_path: Path | None = None,
    precision: str = DEFAULT_PRECISION,
    allow_cpu_fallback: bool = False,
) -> ort.InferenceSession:
    """The ``InferenceSession`` of one stage on ``physical`` (as :class:`Runner` builds it).

    Options from :func:`stage_options`; the CUDA provider with
    :func:`cuda_provider_options` and TF32 on or off for ``precision`` (:func:`providers`;
    CPU as fallback for ops it lacks), allocating from the GPU's shared arena
    (:func:`shared_cuda_allocator`), or the CPU provider (whose
    session runs a BatchNormalization cut from its Conv as a depthwise Conv, see
    :mod:`placement.runtime.ort.layout`). With ``optimized_path``, ONNX Runtime also
    writes the graph it optimised there, weights of a kilobyte or more beside it in
    ``<name>.weights`` (see :mod:`placement.runtime.ort.boundaries`).

    A stage on a GPU whose session did not get the CUDA provider (ONNX Runtime falls
    back to the CPU, with one warning, when the provider cannot load) is refused
    (:func:`check_providers`), unless ``allow_cpu_fallback``.

    Raises:
        PlacementError: ONNX Runtime cannot build the session (names the stage, its
            devices and first op).
        DeviceError: the stage is on a GPU and its session is not (see above).

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
    chosen = providers(physical, precision=precision)
    if physical.is_cuda and shared_cuda_allocator(physical):
        options.add_session_config_entry("session.use_env_allocators", "1")
    try:
        model = stage.model if physical.is_cuda else batchnorm_as_conv(stage.model)
        session = session_from_ir(model, options, chosen)
    except Exception as err:  # ORT raises several types (Fail, InvalidGraph, ...)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PlacementError(
            f"cannot build the ONNX Runtime session of stage {stage.index} "
            f"({stage.device} -> {physical}, {len(stage.ops)} ops starting with "
            f"{stage.ops[0]!r}): {first}"
        ) from err
    check_providers(session, physical, what=f"stage {stage.index} ({stage.device})", allow=allow_cpu_fallback)
    return session


def check_providers(
    session: Any, physical: PhysicalDevice, *, what: str = "the session", allow: bool = False
) -> str:
    """The provider ``session`` really runs on (``session.get_providers()[0]``), checked
    against ``physical``: a session meant for a GPU that came back without the CUDA provider
    raises :class:`DeviceError` naming the provider's load error (:func:`cuda_provider_error`),
    or, with ``allow``, logs a warning and runs on the CPU.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> from placement.runtime.stages import partition
        >>> (stage,) = partition(pl.from_torch(*mlp.build("tiny")))
        >>> check_providers(stage_session(stage, PhysicalDevice("cpu")), PhysicalDevice("cpu"))
        'CPUExecutionProvider'
    """
    got = list(session.get_providers())
    provider = got[0] if got else "none"
    if not physical.is_cuda or provider == "CUDAExecutionProvider":
        return provider
    reason = cuda_provider_error()
    message = f"{what} should run on {physical}, but its ONNX Runtime session runs on {provider}: {reason}"
    if not allow:
        raise DeviceError(message + " (allow_cpu_fallback=True runs it on the CPU anyway)")
    log.warning("%s; running it on the CPU (allow_cpu_fallback)", message)
    return provider


def cuda_provider_error() -> str:
    """Why ONNX Runtime's CUDA provider does not load here, as far as can be told: the
    loader's error for its library (a missing CUDA or cuDNN library), or that this
    ONNX Runtime has none.

    Example:
        >>> isinstance(cuda_provider_error(), str)
        True
    """
    import ctypes

    folder = Path(ort.__file__).parent / "capi"
    found = sorted(folder.glob("*onnxruntime_providers_cuda*"))
    if not found:
        return f"this ONNX Runtime ({ort.__version__}) has no CUDA provider (install onnxruntime-gpu)"
    try:
        ctypes.CDLL(str(found[0]))
    except OSError as err:
        return f"its CUDA provider cannot load: {err}"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this ONNX Runtime does not list the CUDA provider"
    return "the CUDA provider loads but refused the session (see ONNX Runtime's log: placement -v)"


def session_from_ir(model: Any, options: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
    """An ``InferenceSession`` of an ``onnx_ir`` model whose weights bypass the protobuf
    (:func:`placement.graph.session.ort_session`, which every session here goes through).
    """
    return ort_session(model, options, providers)
