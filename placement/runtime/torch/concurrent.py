"""Run a pipelined torch module's stages as a DAG: stages that do not depend on each other at once.

The stages of a placed model form a DAG, not a chain: a tensor-parallel layer is one stage per
device up to its partial sum, and each all-reduce opens the next stage of every device
(:func:`placement.split_tensor_parallel`), so the per-device branches of a layer read only what
the stages before them made. :func:`stage_dependences` finds that DAG from what each stage reads
(the environment keys of :class:`~.stage_exec.TorchStage`). With ``concurrent`` on, the stages run
on :class:`~placement.runtime.schedule.dag.DagWorkers`: a worker thread per stage, each stage
starting a micro-batch once the stages it reads from finished it, so the branches of a layer
compute at the same time (ATen releases the GIL inside its kernels, and a traced stage runs
without Python), forward and backward, and with ``chunks=k`` the stages still pipeline.

``concurrent`` (``pl.to_torch(model, concurrent=...)``, ``module.concurrent``):

* ``None`` (the default): on where it pays, as :class:`placement.Runner` does for ONNX Runtime:
  where the stage graph is wider than a chain, every stage computes on the host (no CUDA
  streams: GPU stages overlap on their own streams already) and the executor runs the stages
  on threads (``executor="auto"`` does for stages big enough to pay for thread hand-offs,
  :data:`~.executor.THREADS_MIN_MACS`).
* ``True``: wherever the stage graph is wider than a chain and computes on the host, whatever
  the stages' size.
* ``False``: never; the stages run as a chain (one after another per micro-batch).

Thread budgets: each worker runs with ``cores // width`` intra-op threads (``width``: the most
stages that can run at once; :func:`placement.runtime.schedule.stage_threads`), so two branches on
two cores compute on one core each instead of four OpenMP threads fighting over two cores.
``torch.set_num_threads`` sets the calling thread's own OpenMP budget where ATen's parallel
backend is OpenMP (:func:`per_thread_budgets`; elsewhere it is process-wide and the workers keep
torch's count); the caller's count is put back after the run.

Gradients: in backward a stage's output gradients are the sum of what the stages reading them
(its dependents) handed back, added in the chain's order (later stages first), so concurrent and
chained runs give the same gradients bit for bit (:class:`GradJoin`).

Example:
    >>> import torch
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> net, (x,) = mlp.build("tiny")
    >>> model = pl.from_torch(net, (x,))
    >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
    >>> module = pl.to_torch(model, device_map={0: "cpu", 1: "cpu"}, concurrent=True)
    >>> torch.allclose(module(x), net(x), atol=1e-5), module.stats.concurrent
    (True, 2)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.errors import InputError
from placement.graph.model import Model
from placement.runtime.schedule import StageWorkers, stage_threads
from placement.runtime.schedule.dag import DagWorkers, dependents_of, graph_width
from placement.runtime.torch.device_streams import has_streams, on_device
from placement.runtime.torch.reentrant import on_engine_thread, run_in_order
from placement.runtime.torch.stage_exec import StepStats, TorchStage, stage_name, worker_context

__all__ = [
    "CONCURRENT",
    "Concurrency",
    "GradJoin",
    "backward_schedule",
    "budgeted",
    "restored_threads",
    "with_final_sink",
    "check_concurrent",
    "concurrent_pays",
    "per_thread_budgets",
    "run_stages",
    "stage_concurrency",
    "stage_dependences",
]

log = logging.getLogger(__name__)

#: The ``concurrent=`` choices: on where it pays, always (where the graph allows), never.
CONCURRENT = (None, True, False)


def check_concurrent(concurrent: object, executor: str = "auto") -> bool | None:
    """``concurrent`` checked: None, True or False; True does not go with ``executor="inline"``.

    Raises:
        InputError: anything else, or ``concurrent=True`` with ``executor="inline"``.

    Example:
        >>> check_concurrent(None), check_concurrent(False)
        (None, False)
    """
    if concurrent not in CONCURRENT or not (concurrent is None or isinstance(concurrent, bool)):
        raise InputError(f"concurrent must be None, True or False, got {concurrent!r}")
    if concurrent is True and executor == "inline":
        raise InputError(
            "concurrent=True runs independent stages on threads of their own; executor='inline' "
            "runs every stage on the caller's thread: choose one"
        )
    return concurrent  # type: ignore[return-value]


def stage_dependences(stages: Sequence[TorchStage]) -> list[tuple[int, ...]]:
    """Per stage (in order), the stages whose outputs it reads."""
    maker: dict[str, int] = {}
    found = []
    for j, stage in enumerate(stages):
        found.append(tuple(sorted({maker[a] for a in stage.args if a in maker and a not in stage.consts})))
        for key, _ in stage.outs:
            maker[key] = j
    return found


@functools.lru_cache(maxsize=1)
def per_thread_budgets() -> bool:
    """Whether ``torch.set_num_threads`` on a thread sets that thread's budget only: ATen's
    parallel backend is OpenMP, whose thread count is per thread (a native thread pool's is
    one for the process)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@dataclass(frozen=True)
class Concurrency:
    """How a call runs its stages at once: ``depends_on`` per stage, ``width`` (most stages
    at once), ``threads`` (intra-op threads per worker; None: torch's own count)."""

    depends_on: tuple[tuple[int, ...], ...]
    width: int
    threads: int | None


def stage_concurrency(
    concurrent: bool | None, stages: Sequence[TorchStage], executor: str, *, cores: int | None = None
) -> Concurrency | None:
    """The DAG run of ``stages`` for ``concurrent`` (see the module docstring) when the stages
    would run on ``executor`` (``"threads"`` or ``"inline"``, resolved); None: run as a chain.

    Example:
        >>> stage_concurrency(False, [], "threads") is None
        True
    """
    if concurrent is False or len(stages) < 2 or any(has_streams(s.device) for s in stages):
        return None
    if concurrent is None and executor != "threads":
        return None
    deps = tuple(stage_dependences(stages))
    width = graph_width(deps)
    if width < 2:
        return None
    return Concurrency(deps, width, stage_threads(width, cores=cores) if per_thread_budgets() else None)


def concurrent_pays(
    model: Model, physical: Sequence[str], concurrent: bool | None, executor: str, *, cores: int | None = None
) -> bool:
    """Whether ``to_torch(model, chunks=1)`` should run the stages as a DAG (a one-micro-batch
    :class:`~.pipelined.PipelinedModule`) rather than as one ``GraphModule``: the placed
    stage graph is wider than a chain, no stage is on a GPU (``physical``: the physical devices),
    and ``concurrent=True``, ``executor="threads"`` or (``None``, ``"auto"``) a host stage
    does at least :data:`~.executor.THREADS_MIN_MACS` multiply-adds on the inputs' static
    shapes (a symbolic dimension counts 1), on a machine with several cores.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> model = pl.from_torch(*mlp.build("tiny"))
        >>> _ = pl.split_tensor_parallel(model, devices=[0, 1])
        >>> concurrent_pays(model, ["cpu"], None, "auto"), concurrent_pays(model, ["cpu"], True, "auto")
        (False, True)
    """
    import os

    from placement.runtime.stages import partition
    from placement.runtime.torch.executor import THREADS_MIN_MACS

    if concurrent is False or executor == "inline" or any(str(p).startswith("cuda") for p in physical):
        return False
    stages = partition(model)
    if graph_width([s.depends_on for s in stages]) < 2:
        return False
    if concurrent is True or executor == "threads":
        return True
    if (cores if cores is not None else (os.cpu_count() or 1)) < 2:
        return False
    inits = model.graph.initializers
    biggest = max(
        sum(_elements(inits[name].shape) for name in stage.parameters if name in inits) for stage in stages
    )
    return _static_rows(model) * biggest >= THREADS_MIN_MACS


def _elements(shape: Any) -> int:
    total = 1
    for dim in shape or ():
        total *= dim if isinstance(dim, int) else 1
    return total


def _static_rows(model: Model) -> int:
    """Rows of the model's inputs on their static shapes (see :func:`.executor.input_rows`)."""
    rows = 1
    inits = model.graph.initializers
    for value in model.graph.inputs:
        if value.name in inits or value.shape is None or len(value.shape) == 0:
            continue
        dims = [d if isinstance(d, int) else 1 for d in value.shape]
        floating = value.dtype is not None and value.dtype.is_floating_point()
        rows = max(rows, _elements(dims[:-1]) if floating else _elements(dims))
    return rows


@dataclass
class GradJoin:
    """One micro-batch's gradients in a concurrent backward: ``base`` (the gradients of the
    model's outputs) and, per stage that ran its backward, the gradients of its inputs."""

    base: dict[str, Any]
    deltas: dict[int, dict[str, Any]] = field(default_factory=dict)

    def gather(self, stage: TorchStage, dependents: Sequence[int]) -> dict[str, Any]:
        """The gradients of ``stage``'s outputs: the base's, then its dependents' (the stages
        reading them), later stages first, as the chained backward adds them."""
        genv: dict[str, Any] = {}
        for key, _ in stage.outs:
            parts = [self.base[key]] if key in self.base else []
            parts += [self.deltas[d][key] for d in sorted(dependents, reverse=True) if key in self.deltas[d]]
            if parts:
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                genv[key] = total
        return genv

    def merged(self) -> dict[str, Any]:
        """Every gradient, summed over the stages in the chained backward's order."""
        genv = dict(self.base)
        for j in sorted(self.deltas, reverse=True):
            for key, grad in self.deltas[j].items():
                genv[key] = grad if key not in genv else genv[key] + grad
        return genv


def _joined(fn: Callable[[int, Any], Any], stage: TorchStage, dependents: Sequence[int]) -> Any:
    """A chained backward ``fn(i, genv)`` run on a :class:`GradJoin`: its output gradients
    gathered, its input gradients kept apart (other stages run beside it)."""

    def run(i: int, join: GradJoin) -> GradJoin:
        genv = join.gather(stage, dependents)
        before = set(genv)
        fn(i, genv)
        join.deltas[stage.index] = {k: v for k, v in genv.items() if k not in before}
        return join

    return run


def with_final_sink(plan: Concurrency) -> Concurrency:
    """``plan`` with its last stage made to wait for every other stage nothing reads (the
    stage computing a loss reads all the model's outputs)."""
    deps = [set(d) for d in plan.depends_on]
    read = {d for mine in deps for d in mine}
    last = len(deps) - 1
    deps[last] |= {j for j in range(last) if j not in read}
    return Concurrency(tuple(tuple(sorted(d)) for d in deps), plan.width, plan.threads)


def budgeted(base: Callable[[int], Any], plan: Concurrency | None) -> Callable[[int], Any]:
    """``base`` (a worker's context factory) with the worker's intra-op thread budget set on
    entry (``plan.threads``; nothing without a plan or a budget). Run inside
    :func:`restored_threads`, which puts the caller's count back."""
    if plan is None or plan.threads is None:
        return base
    threads = plan.threads

    @contextlib.contextmanager
    def context(j: int) -> Iterator[None]:
        torch.set_num_threads(threads)
        with base(j):
            yield

    return context


@contextlib.contextmanager
def restored_threads(plan: Concurrency | None) -> Iterator[None]:
    """Put this thread's intra-op thread count back after workers set theirs
    (``torch.set_num_threads`` also sets the count threads started later begin with)."""
    caller = torch.get_num_threads()
    try:
        yield
    finally:
        if plan is not None and plan.threads is not None:
            torch.set_num_threads(caller)


@contextlib.contextmanager
def _dag_workers(
    stages: list[TorchStage],
    fns: list[Any],
    plan: Concurrency,
    depends_on: Sequence[Sequence[int]],
    grad: bool,
) -> Iterator[DagWorkers]:
    """DAG workers for ``stages``, each with its intra-op budget (:func:`budgeted`)."""
    context = budgeted(worker_context(stages, grad), plan)
    with (
        restored_threads(plan),
        DagWorkers(fns, depends_on, [stage_name(s) for s in stages], context=context) as w,
    ):
        yield w


def run_stages(
    stages: list[TorchStage],
    make: Callable[[TorchStage], Any],
    payloads: list[Any],
    *,
    grad: bool,
    executor: str,
    plan: Concurrency | None = None,
    stats: StepStats | None = None,
) -> list[Any]:
    """Run ``payloads`` through ``stages``: as a DAG with ``plan`` (the stages' functions fill
    in each payload), else in the fill-drain order on the stage workers (``executor="threads"``)
    or on this thread (``"inline"``: stage ``j`` of micro-batch ``t - j`` at tick ``t``,
    inside the stage's grad mode and, on a GPU, its device and stream). Results in order."""
    fns = [make(s) for s in stages]
    if plan is not None:
        with _dag_workers(stages, fns, plan, plan.depends_on, grad) as w:
            results = w.map(payloads)
        if stats is not None:
            stats.timeline = list(w.timeline)
        return results
    if executor == "inline":
        return run_in_order(
            fns, [stage_name(s) for s in stages], payloads, context=worker_context(stages, grad)
        )
    with stage_workers(stages, fns, grad=grad) as w:
        return w.map(payloads)


def stage_workers(stages: list[TorchStage], fns: list[Any], *, grad: bool) -> StageWorkers:
    """The chained pipeline's workers for ``stages`` in the order given, ``fns`` their
    functions: grad mode and CUDA stream per worker. The last stage runs on the caller's
    thread, which waits for its results anyway: one thread and one hand-off per micro-batch
    fewer (on a GPU it queues its kernels on its own stream there, as its worker would)."""
    return StageWorkers(
        fns, [stage_name(s) for s in stages], context=worker_context(stages, grad), inline_last=True
    )


def backward_schedule(
    stages: list[TorchStage],
    make: Callable[[TorchStage], Any],
    genvs: list[dict[str, Any]],
    executor: str,
    plan: Concurrency | None = None,
) -> list[dict[str, Any]]:
    """Run the micro-batches' gradient environments, last first, through ``stages`` (in
    backward order): as :func:`run_stages` does, or on this thread when it is an autograd
    engine thread, which must never wait on threads that call into autograd
    (:mod:`placement.runtime.torch.reentrant`). With ``plan`` the stages run as the reversed
    DAG (a stage's backward once every stage reading its outputs ran theirs). Results last
    micro-batch first."""
    order = list(reversed(range(len(genvs))))
    if plan is not None:
        return _backward_dag(stages, make, genvs, order, plan)
    fns, names = [make(s) for s in stages], [stage_name(s) for s in stages]
    if on_engine_thread():
        log.debug("pipelined backward on an autograd engine thread: %d stages run inline", len(stages))
        devices = [s.device for s in stages]

        def context(j: int) -> Any:
            return on_device(devices[j]) if has_streams(devices[j]) else contextlib.nullcontext()

        return run_in_order(fns, names, [genvs[i] for i in order], ids=order, context=context)
    if executor == "inline":
        return run_in_order(
            fns, names, [genvs[i] for i in order], ids=order, context=worker_context(stages, True)
        )
    with stage_workers(stages, fns, grad=True) as w:
        for i in order:
            w.submit(i, genvs[i])
        return [w.result() for _ in order]


def _backward_dag(
    reversed_stages: list[TorchStage],
    make: Callable[[TorchStage], Any],
    genvs: list[dict[str, Any]],
    order: list[int],
    plan: Concurrency,
) -> list[dict[str, Any]]:
    n = len(reversed_stages)
    dependents = dependents_of(plan.depends_on)  # forward indices
    # in backward order, stage r = n - 1 - j waits for the stages that read stage j's outputs
    back_deps = [tuple(sorted(n - 1 - d for d in dependents[n - 1 - r])) for r in range(n)]
    fns = [_joined(make(s), s, dependents[s.index]) for s in reversed_stages]
    joins = [GradJoin(genvs[i]) for i in order]
    if on_engine_thread():  # never wait on workers here: the reversed order is a topological one
        for i, join in zip(order, joins):
            for r, fn in enumerate(fns):
                with worker_context(reversed_stages, True)(r):
                    fn(i, join)
        return [join.merged() for join in joins]
    with _dag_workers(reversed_stages, fns, plan, back_deps, True) as w:
        for i, join in zip(order, joins):
            w.submit(i, join)
        return [w.result().merged() for _ in order]
