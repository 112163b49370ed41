"""Provider and session options of ``benchmarks/gpu_diagnose.py``, one at a time.

Each option variant is the slow configuration (two stage sessions chained by hand, one
more session of the unplaced model alive) with one option given to every session of
the process. Options that need the CUDA provider are skipped elsewhere, with the reason.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import onnxruntime as ort
import torch

from benchmarks.gpu_diagnose_sessions import Chain, Setup, other_session, run_on_thread, stage_sessions

__all__ = ["build_option", "CUDA_ONLY"]

#: Options that only mean something to the CUDA provider.
CUDA_ONLY = {
    "opt:user_compute_stream",
    "opt:copy_in_default_stream=0",
    "opt:arena_next_power_of_two",
    "opt:cudnn_heuristic",
    "opt:cuda_graph",
    "opt:torch_allocator",
}

_PROVIDER = {
    "opt:copy_in_default_stream=0": {"do_copy_in_default_stream": "0"},
    "opt:arena_next_power_of_two": {"arena_extend_strategy": "kNextPowerOfTwo"},
    "opt:cudnn_heuristic": {"cudnn_conv_algo_search": "HEURISTIC"},
}


def build_option(name: str, setup: Setup, keep: list[Any], notes: list[str]) -> Callable[[], Any] | None:
    """The timed call of option variant ``name``, or None (skipped; the reason in ``notes``)."""
    if name in CUDA_ONLY and not setup.cuda:
        notes.append("needs the CUDA provider (skipped without a GPU)")
        return None
    kw: dict[str, Any] = {}
    if name in _PROVIDER:
        kw["provider"] = _PROVIDER[name]
    elif name == "opt:user_compute_stream":
        stream = torch.cuda.Stream()
        keep.append(stream)
        kw["provider"] = {"has_user_compute_stream": "1", "user_compute_stream": str(stream.cuda_stream)}
    elif name == "opt:one_thread_no_spin":
        kw.update(threads=1, config={"session.intra_op.allow_spinning": "0"})
    elif name == "opt:shared_arena":
        if not _register_shared_arena(setup, notes):
            return None
        kw["config"] = {"session.use_env_allocators": "1"}
    elif name == "opt:torch_allocator":
        kw["provider"] = _torch_allocator(keep)
        notes.append("ctypes callbacks: each allocation takes the GIL")
    elif name == "opt:cuda_graph":
        return _graph_chain(setup, keep, notes)
    chain = Chain(setup, stage_sessions(setup, **kw))
    keep.append(chain)
    keep.append(other_session(setup, **kw))
    return run_on_thread(chain) if name == "opt:dedicated_thread" else chain


def _register_shared_arena(setup: Setup, notes: list[str]) -> bool:
    """One arena for every session of the process (CUDA: as ``pl.Runner``'s stages get it)."""
    if setup.cuda:
        from placement.runtime.device_map import PhysicalDevice
        from placement.runtime.ort.sessions import shared_cuda_allocator

        if shared_cuda_allocator(PhysicalDevice("cuda", 0)):
            return True
        notes.append("this onnxruntime cannot register a shared CUDA arena")
        return False
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
    return True


def _torch_allocator(keep: list[Any]) -> dict[str, str]:
    """Provider options that send the CUDA provider's allocations to torch's caching allocator."""
    torch.cuda.init()
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(
        lambda size: torch.cuda.caching_allocator_alloc(int(size), 0)
    )
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda ptr: torch.cuda.caching_allocator_delete(ptr))
    empty = ctypes.CFUNCTYPE(None)(torch.cuda.empty_cache)
    keep.extend([alloc, free, empty])  # the callbacks must outlive the sessions
    return {
        "gpu_external_alloc": str(ctypes.cast(alloc, ctypes.c_void_p).value),
        "gpu_external_free": str(ctypes.cast(free, ctypes.c_void_p).value),
        "gpu_external_empty_cache": str(ctypes.cast(empty, ctypes.c_void_p).value),
    }


def _graph_chain(setup: Setup, keep: list[Any], notes: list[str]) -> Callable[[], Any] | None:
    """The chain with ``enable_cuda_graph`` on both stages: inputs and outputs bound once to
    fixed torch buffers (stage 1 reads stage 0's output buffers); each call copies the input in."""
    plain = Chain(setup, stage_sessions(setup))
    first = dict(zip(setup.stage_outputs[0], _outputs(plain.sessions[0], setup, plain.value)))
    first.update(zip(setup.stage_outputs[1], plain()))
    del plain
    try:
        sessions = stage_sessions(setup, provider={"enable_cuda_graph": "1"})
    except Exception as err:  # noqa: BLE001 (ORT refuses the option when a node is not on CUDA)
        notes.append(f"ORT refused enable_cuda_graph: {str(err).strip().splitlines()[0][:160]}")
        return None
    notes.append("captured only if every node of a stage is on the CUDA provider")
    x = torch.from_numpy(setup.feed()).cuda()
    static_x = x.clone()
    buffers = {name: torch.empty(v.shape(), dtype=_TORCH_TYPES[v.data_type()], device="cuda:0")
               for name, v in first.items()}  # fmt: skip
    bindings = []
    for stage, session in enumerate(sessions):
        binding = session.io_binding()
        for name in setup.stage_inputs[stage]:
            tensor = static_x if stage == 0 else buffers[setup.sources.get(name, name)]
            _bind(binding.bind_input, name, tensor)
        for out in session.get_outputs():
            _bind(binding.bind_output, out.name, buffers[out.name])
        bindings.append(binding)
    keep.extend([sessions, buffers, static_x, bindings, other_session(setup)])

    def call() -> None:
        static_x.copy_(x)
        torch.cuda.current_stream().synchronize()  # ONNX Runtime reads it on its own stream
        for session, binding in zip(sessions, bindings):
            session.run_with_iobinding(binding)

    return call


#: ONNX Runtime's type names -> torch dtypes (the fixed buffers of the CUDA-graph chain).
_TORCH_TYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


def _outputs(session: ort.InferenceSession, setup: Setup, value: Any) -> list[Any]:
    from benchmarks.gpu_diagnose_sessions import bind_run, device_of

    return bind_run(session, {setup.input_name: value}, device_of(setup))


def _bind(bind: Callable[..., None], name: str, tensor: Any) -> None:
    dtype = tensor.new_empty(()).cpu().numpy().dtype
    bind(name, "cuda", 0, dtype, tuple(tensor.shape), tensor.data_ptr())
