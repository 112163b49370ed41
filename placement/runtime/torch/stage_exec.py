"""Running one stage of a pipelined torch module: what the GPipe forward/backward and 1F1B share.

A :class:`TorchStage` is one fx submodule of the split lowered module, with the
environment keys it reads and defines. Micro-batches travel between stages as
*environments* (``dict`` of key -> value); on a GPU each carries a CUDA event
(:func:`signal`, :func:`wait_for`) so a worker's stream waits only for the work
its inputs came from. Gradients travel the same way back.

Example:
    >>> import torch
    >>> env = microbatch_envs(["x"], [0], 2, [torch.arange(4.0)])
    >>> [e["x"].tolist() for e in env]
    [[0.0, 1.0], [2.0, 3.0]]
    >>> detached(env[0]["x"], True).requires_grad
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from placement.lowering.ops.training import ModeBatchNorm, ModeDropout, replaying
from placement.runtime.schedule import split_batch
from placement.runtime.torch.device_streams import (
    current_stream,
    has_streams,
    new_stream,
    on_stream,
    record_event,
    record_stream,
    tensor_device,
    wait_event,
)

#: The lowering's train/eval-mode modules (see :mod:`placement.lowering.ops.training`).
MODE_MODULES = (ModeBatchNorm, ModeDropout)

__all__ = [
    "StepStats",
    "TorchStage",
    "autocast_like",
    "autocast_matches",
    "caller_autocast",
    "accumulate",
    "accumulate_owned",
    "accumulate_microbatch",
    "add_input_grads",
    "backward_operands",
    "call_stage",
    "detached",
    "forward_for_backward",
    "input_slots",
    "keeps_activations",
    "microbatch_envs",
    "owned_grads",
    "per_parameter",
    "stage_args",
    "signal",
    "signal_all",
    "stage_name",
    "hand_over",
    "join_streams",
    "stage_stream",
    "static_grads",
    "trainable_params",
    "value_devices",
    "wait_for",
    "wait_for_stage",
    "worker_context",
    "write_grads",
]


@dataclass
class TorchStage:
    """One stage of the split lowered torch module: its fx submodule, what it reads and what it
    defines (ONNX Runtime's stage, a session per device, is :class:`placement.runtime.stages.Stage`)."""

    index: int
    module: fx.GraphModule
    args: list[str]  # env keys it reads, in call order
    outs: list[tuple[str, int | None]]  # env key -> index into its result (None: the result itself)
    device: torch.device
    consts: dict[str, Any] = field(default_factory=dict)  # args that are module attributes (parameters)
    call: Any = None  # a TracedStage of ``module``: traces it for inference (see traced.py)
    part: int = 0  # the stage of ``partition(model)`` it runs (``index`` skips stages with no code)
    stream: Any = None  # its CUDA stream, made once and kept across calls (GPU stages only)


def stage_stream(stage: TorchStage) -> Any:
    """``stage``'s own CUDA stream, made on first use and kept: every call of the pipeline
    queues the stage's work on the same stream, so the caching allocator reuses its blocks."""
    if stage.stream is None:
        stage.stream = new_stream(stage.device)
    return stage.stream


@dataclass
class StepStats:
    """What the pipeline did in its last step (a forward and its backward, or a ``train_step``).

    Attributes:
        microbatches: micro-batches the step ran.
        recomputed: per stage, the forwards it ran again in backward because checkpointing
            dropped their activations (``checkpoint=``); :attr:`total_recomputed` sums them.
        deferred: groups of weight gradients ``train_step`` computed apart from their
            backward (``defer_weights=``).
        executor: who ran the stages: ``"threads"`` (a thread per stage) or ``"inline"``
            (the caller's thread); see :mod:`placement.runtime.torch.executor`.
        concurrent: the most stages that could run at once when stages that do not depend
            on each other ran at once (:mod:`placement.runtime.torch.concurrent`); 0 when
            the stages ran as a chain.
        timeline: with ``concurrent``, the forward's (stage, micro-batch) runs with their
            start and end times and threads
            (:class:`~placement.runtime.schedule.dag.StageRun`).
    """

    microbatches: int = 0
    recomputed: list[int] = field(default_factory=list)
    deferred: int = 0
    executor: str = ""
    concurrent: int = 0
    timeline: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, stages: int, microbatches: int, executor: str = "", plan: Any = None) -> StepStats:
        """Zeroed counts for a step of ``microbatches`` through ``stages`` stages (``plan``:
        the :class:`~placement.runtime.torch.concurrent.Concurrency` it runs with, if any)."""
        return cls(microbatches, [0] * stages, 0, executor, plan.width if plan is not None else 0)

    @property
    def total_recomputed(self) -> int:
        """Stage forwards recomputed in the step, all stages together."""
        return sum(self.recomputed)


def stage_name(stage: TorchStage) -> str:
    """How errors and threads name a stage."""
    return f"stage {stage.index} on {stage.device}"


def worker_context(stages: list[TorchStage], grad: bool) -> Callable[[int], Any]:
    """Per worker: the grad mode, and on a GPU the stage's own CUDA stream.

    Without grad the workers run in ``torch.inference_mode()``: no version counters or
    view tracking on the values between stages (1-3% of a bench GPT stage on the CPU).
    Those values never leave the pipeline: the caller gets outputs concatenated outside
    it, ordinary tensors."""

    casts = caller_autocast()

    @contextlib.contextmanager
    def on_gpu(stage: TorchStage) -> Iterator[None]:
        with torch.set_grad_enabled(True) if grad else torch.inference_mode():
            with on_stream(stage.device, stage_stream(stage)):
                with autocast_like(casts):
                    yield

    @contextlib.contextmanager
    def on_host(mode: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        with mode, autocast_like(casts):
            yield

    def enter(j: int) -> contextlib.AbstractContextManager[Any]:
        # Entered around every call of a stage run on the caller's thread: on the CPU, the
        # grad mode's own context manager (none when it is already on), not a generator.
        stage = stages[min(j, len(stages) - 1)]
        if has_streams(stage.device):
            return on_gpu(stage)
        mode: contextlib.AbstractContextManager[Any]
        if not grad:
            mode = torch.inference_mode()
        else:
            mode = contextlib.nullcontext() if torch.is_grad_enabled() else torch.enable_grad()
        return on_host(mode) if casts and not autocast_matches(casts) else mode

    return enter


#: Device types whose autocast state a worker takes over from the caller.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def caller_autocast() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """This thread's autocast state: per device type with autocast on, (type, dtype, cache).

    Autocast is thread-local: a worker thread starts with it off, so a stage run there
    would compute in full precision what the caller's thread computes in bf16. Workers
    enter :func:`autocast_like` with the state captured on the caller's thread.

    Example:
        >>> import torch
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     [(device, dtype) for device, dtype, _cache in caller_autocast()]
        [('cpu', torch.bfloat16)]
        >>> caller_autocast()
        ()
    """
    found = []
    for device_type in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            found.append((device_type, dtype, torch.is_autocast_cache_enabled()))
    return tuple(found)


def autocast_matches(casts: Sequence[tuple[str, torch.dtype, bool]]) -> bool:
    """Whether this thread already runs under the autocast state ``casts``."""
    return all(torch.is_autocast_enabled(t) and torch.get_autocast_dtype(t) == dtype for t, dtype, _ in casts)


@contextlib.contextmanager
def autocast_like(casts: Sequence[tuple[str, torch.dtype, bool]]) -> Iterator[None]:
    """Enter the autocast state ``casts`` (from :func:`caller_autocast`) where it is not on yet,
    and turn autocast off for the device types it does not name: a checkpointed stage
    recomputed inside a ``backward()`` called under autocast runs as its forward did."""
    with contextlib.ExitStack() as stack:
        named = {device_type for device_type, _, _ in casts}
        for device_type in _AUTOCAST_DEVICES:
            if device_type not in named and torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        for device_type, dtype, cache in casts:
            if not autocast_matches([(device_type, dtype, cache)]):
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        yield


def wait_for(env: dict[str, Any], *devices: torch.device) -> None:
    """Make this thread's current stream on each of ``devices`` (none given: on the current
    device) wait for the work that produced ``env`` (devices with streams only).

    A kernel runs on the current stream of its tensors' device: a caller that reads values
    on another device than its current one (the last stage's outputs on ``cuda:1``, read by a
    caller on ``cuda:0``) names that device, or its reads are not ordered after the work."""
    event = env.pop("__event__", None)
    if event is None:
        return
    for device in devices or (None,):
        wait_event(current_stream(device), event)


def wait_for_stage(env: dict[str, Any], device: torch.device) -> None:
    """:func:`wait_for` as a stage on ``device`` needs it: a stage with streams waits on its
    current stream; a host stage on this thread's current stream of every stream device its
    values live on, since its copies of them to the host run there (a value on ``cuda:1``
    read by a host stage whose current device is ``cuda:0``)."""
    if has_streams(device):
        wait_for(env)
    else:
        wait_for(env, *value_devices([env]))


def value_devices(envs: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> list[torch.device]:
    """The stream devices the tensors under ``keys`` (all keys when None) of ``envs`` live on,
    each once, in order of first appearance. The keys of an env are copied first (in one
    step under the GIL): the branches of a split layer running at once write into the same
    env while one of them looks here."""
    found: dict[torch.device, None] = {}
    for env in envs:
        for key in list(env) if keys is None else keys:
            device = tensor_device(env.get(key))
            if device is not None:
                found[device] = None
    return list(found)


def signal(env: dict[str, Any], device: torch.device) -> None:
    """Record, in ``env``, an event after the work this thread queued so far on ``device``'s
    current stream (devices with streams only).

    A stage on a device without streams (the host) can still queue work on a GPU: the
    backward of its copy from a GPU input is a copy of the gradient back to that GPU, queued
    on this thread's current stream there, whose DMA can still be running when the call
    returns. Its consumer (the GPU stage before it) must wait for that stream, so a host
    stage records the event on this thread's current stream of the first stream device its
    values live on, behind the others' (:func:`signal_all`)."""
    if has_streams(device):
        env["__event__"] = record_event(current_stream(device))
        return
    devices = value_devices([env])
    if devices:
        signal_all([env], devices)


def signal_all(envs: Sequence[dict[str, Any]], devices: Sequence[torch.device]) -> None:
    """Record, in each of ``envs``, one event behind the work queued so far on this thread's
    current streams of all ``devices`` (the first one's stream waits for the others')."""
    if not devices:
        return
    first = current_stream(devices[0])
    for device in devices[1:]:
        wait_event(first, record_event(current_stream(device)))
    for env in envs:
        signal(env, devices[0])


def join_streams(stages: Sequence[TorchStage]) -> None:
    """Make the caller's stream wait for the work the stages queued on their own streams (an
    event per stage stream; the host never waits): what the caller reads next (outputs,
    gradients handed to ``.grad``) is ordered after it on the GPU."""
    for stage in stages:
        if stage.stream is not None and has_streams(stage.device):
            event = record_event(stage.stream)
            wait_event(current_stream(stage.device), event)


def hand_over(tensor: Any, event: Any = None) -> Any:
    """Mark a ``tensor`` made on another stream as used by this thread's current stream on its
    device (``record_stream``), so the caching allocator does not reuse its memory while that
    stream's queued work may still read it; with ``event`` (recorded behind the work that made
    it), that stream first waits for it. Other values, and tensors on devices without
    streams, pass through."""
    device = tensor_device(tensor)
    if device is not None:
        stream = current_stream(device)
        if event is not None:
            wait_event(stream, event)
        record_stream(tensor, stream)
    return tensor


def call_stage(stage: TorchStage, args: list[Any], *, immediate: bool = False) -> dict[str, Any]:
    """Run ``stage`` on ``args``: its outputs by environment key. ``immediate``: the outputs'
    backward follows at once (a graphed stage then replays forward and backward together,
    see :mod:`placement.runtime.torch.stage_graphs`)."""
    result = (
        stage.call.immediate(*args) if immediate and hasattr(stage.call, "immediate") else stage.call(*args)
    )
    return {key: result if index is None else result[index] for key, index in stage.outs}


def microbatch_envs(
    placeholders: Sequence[str], axes: Sequence[int | None], chunks: int, inputs: Sequence[Any]
) -> list[dict[str, Any]]:
    """The graph inputs cut into ``chunks`` micro-batches along ``axes``, one environment each."""
    parts = split_batch(list(inputs), axes, chunks)
    envs = []
    for part in parts:
        env = dict(zip(placeholders, part))
        device = next((d for d in map(tensor_device, part) if d is not None), None)
        if device is not None:  # made on the caller's stream there
            signal(env, device)
        envs.append(env)
    return envs


def detached(value: Any, requires_grad: bool) -> Any:
    """A stage's input: ``value`` cut from the graph that made it, a leaf that requires grad when
    ``requires_grad`` and it is floating point (non-tensors pass through)."""
    if isinstance(value, torch.Tensor):
        leaf = hand_over(value.detach())  # made on another stage's (or the caller's) stream
        if requires_grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf
    return value


def stage_args(
    stage: TorchStage, env: dict[str, Any], tracked: Callable[[str], bool] | None = None
) -> list[Any]:
    """``stage``'s call arguments: its parameters, and its inputs read from ``env``; with
    ``tracked``, each input cut from the graph that made it (:func:`detached`), a leaf that
    requires grad where ``tracked(key)``."""
    if tracked is None:
        args = [stage.consts[a] if a in stage.consts else env[a] for a in stage.args]
        for arg in args:  # a host stage's copies of GPU values to the host read them there too
            hand_over(arg)
        return args
    return [stage.consts[a] if a in stage.consts else detached(env[a], tracked(a)) for a in stage.args]


def trainable_params(stage: TorchStage) -> list[tuple[int, str]]:
    """``stage``'s parameters that take a gradient: (argument slot, key)."""
    consts = stage.consts
    return [(n, key) for n, key in enumerate(stage.args) if key in consts and consts[key].requires_grad]


def keeps_activations(checkpoint: str, microbatch: int, count: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``count`` keeps its activations for backward under
    ``checkpoint`` (else it drops them and recomputes them there)."""
    return checkpoint == "never" or (checkpoint == "except_last" and microbatch == count - 1)


def forward_for_backward(
    stage: TorchStage, args: list[Any], keep: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run ``stage`` for a training step: its outputs, and what to save for backward (the outputs
    with their autograd graph when ``keep``, else None: run without grad, recomputed later)."""
    if not keep and _mode_dependent(stage):  # recomputed later: with the same Dropout masks
        seed = int(torch.randint(0, 2**62, ()).item())
        with torch.no_grad(), replaying(seed, recompute=False):
            outs = call_stage(stage, args)
        return outs, {_SEED: seed}
    with torch.enable_grad() if keep else torch.no_grad():
        outs = call_stage(stage, args)
    return outs, outs if keep else None


_SEED = "__placement_replay_seed__"


def _mode_dependent(stage: TorchStage) -> bool:
    """Whether ``stage`` holds a train/eval-mode op of a training export (Dropout draws
    masks, BatchNorm updates running buffers): its recomputation must replay, not redo."""
    found = getattr(stage, "_mode_dependent", None)
    if found is None:
        module = stage.module
        found = any(
            node.op == "call_module" and isinstance(module.get_submodule(str(node.target)), MODE_MODULES)
            for node in module.graph.nodes
        )
        stage._mode_dependent = found  # type: ignore[attr-defined]
    return found


def backward_operands(
    stage: TorchStage,
    args: list[Any],
    outs: dict[str, Any] | None,
    genv: dict[str, Any],
    params: Sequence[tuple[int, str]],
    stats: StepStats | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """What one (stage, micro-batch) back-propagates: its outputs that have a gradient in
    ``genv``, those gradients, and the slots of its inputs (not ``params``) that take one.
    ``outs`` None (checkpointed) recomputes the stage first (counted in ``stats``)."""
    if outs is None or _SEED in outs:
        seed = None if outs is None else outs[_SEED]
        replay = contextlib.nullcontext() if seed is None else replaying(seed, recompute=True)
        with torch.enable_grad(), replay:
            outs = call_stage(stage, args, immediate=True)
        if stats is not None:
            stats.recomputed[stage.index] += 1
    pairs = [
        (outs[k], hand_over(genv[k]))  # made on the next stage's stream (or the caller's)
        for k, _ in stage.outs
        if k in genv and isinstance(outs[k], torch.Tensor) and outs[k].requires_grad
    ]
    return [o for o, _ in pairs], [g for _, g in pairs], input_slots(args, params)


def static_grads(stage: TorchStage) -> bool:
    """Whether ``stage``'s gradients come out of buffers its next backward overwrites (a
    CUDA-graphed stage): callers clone them, and compute weight gradients with the inputs'."""
    return bool(getattr(stage.call, "static_grads", False))


def owned_grads(stage: TorchStage, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``grads`` from ``stage``'s backward, cloned where they live in static buffers."""
    if not static_grads(stage):
        return list(grads)
    return [g.clone() if g is not None else None for g in grads]


def input_slots(args: Sequence[Any], params: Sequence[tuple[int, str]]) -> list[int]:
    """The slots of a stage's ``args`` that take a gradient and are not among ``params``."""
    param_slots = {n for n, _ in params}
    return [
        n
        for n, a in enumerate(args)
        if n not in param_slots and isinstance(a, torch.Tensor) and a.requires_grad
    ]


def add_input_grads(
    genv: dict[str, Any], stage: TorchStage, slots: Sequence[int], grads: Sequence[torch.Tensor | None]
) -> None:
    """Add the gradients of ``stage``'s inputs in ``slots`` to ``genv``, under the inputs' keys."""
    for n, g in zip(slots, grads):
        if g is not None:
            accumulate(genv, stage.args[n], g)


def per_parameter(
    stages: Sequence[TorchStage], param_grads: Sequence[dict[str, torch.Tensor]], owned: Sequence[set[str]]
) -> dict[int, tuple[torch.Tensor, torch.Tensor, bool]]:
    """Each parameter's gradient summed over the stages that read it (a tied weight), by
    ``id(parameter)``: (parameter, gradient, whether the gradient is an accumulator made here
    rather than a tensor autograd handed out)."""
    total: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}
    for stage, grads, mine in zip(stages, param_grads, owned):
        for key, g in grads.items():
            param = stage.consts[key]
            if id(param) in total:
                total[id(param)] = (param, total[id(param)][1] + g.to(param.device), True)
            else:
                total[id(param)] = (param, g, key in mine)
    return total


def accumulate(env: dict[str, Any], key: str, grad: torch.Tensor) -> None:
    env[key] = grad if key not in env else env[key] + grad


def accumulate_owned(acc: dict[str, torch.Tensor], owned: set[str], key: str, grad: torch.Tensor) -> None:
    """Sum a parameter's gradient over micro-batches, allocating one accumulator, not one per micro-batch.

    The first gradient is kept as it is (autograd may hand out a tensor it shares);
    the second makes a new accumulator, which later ones are added to in place.
    """
    total = acc.get(key)
    if total is None:
        acc[key] = grad
    elif key in owned:
        total.add_(grad)
    else:
        acc[key] = total + grad
        owned.add(key)


def accumulate_microbatch(
    acc: dict[str, torch.Tensor], owned: set[str], grads: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """One micro-batch's parameter gradients (``(key, gradient)``, each key once) added to the
    sums in ``acc``, as :func:`accumulate_owned` adds each, but with one ``_foreach_add_``
    for the accumulators already made here instead of an ``add_`` per parameter (the same
    additions, so the same sums bit for bit).

    Example:
        >>> import torch
        >>> acc, owned = {}, set()
        >>> for g in (torch.ones(2), torch.ones(2), torch.ones(2)):
        ...     accumulate_microbatch(acc, owned, [("w", g)])
        >>> acc["w"].tolist(), owned
        ([3.0, 3.0], {'w'})
    """
    inplace_keys, inplace_grads = [], []
    for key, grad in grads:
        if key in owned:
            inplace_keys.append(key)
            inplace_grads.append(grad)
        else:
            accumulate_owned(acc, owned, key, grad)
    if len(inplace_keys) > 1 and len(set(inplace_keys)) == len(inplace_keys) and _FOREACH_ADD is not None:
        _FOREACH_ADD([acc[key] for key in inplace_keys], inplace_grads)
    else:
        for key, grad in zip(inplace_keys, inplace_grads):
            acc[key].add_(grad)


_FOREACH_ADD = getattr(torch, "_foreach_add_", None)  # a fused list add where torch has one


def write_grads(
    stages: list[TorchStage], param_grads: list[dict[str, torch.Tensor]], owned: list[set[str]]
) -> None:
    """Add each stage's parameter gradients to ``.grad`` (summed over the stages sharing a parameter).

    A gradient that is one autograd result, not an accumulator made here, is copied before
    it becomes a ``.grad`` (autograd may share it)."""
    for param, g, fresh in per_parameter(stages, param_grads, owned).values():
        g = hand_over(g.to(param.device))  # made on a worker's stream, read on the caller's
        if param.grad is None:
            param.grad = g if fresh else g.clone()
        else:
            param.grad.add_(g)
