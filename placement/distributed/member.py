"""One rank of a placed pipeline: what every rank-side runner shares.

:class:`RankMember` is the base of :class:`~placement.distributed.DistributedPipeline`
(torch stages) and :class:`~placement.distributed.DistributedRunner` (ONNX Runtime
stages). It joins the process group as one rank of the placement (checking that
the group has as many ranks as the placement has rank groups), picks the rank's
device, checks rank 0's inputs against the graph's batch size, and keeps the
heartbeat :class:`~placement.distributed.watchdog.Watchdog` that turns a peer's
failure into a :class:`~placement.distributed.errors.RankFailedError` naming it.

Example:
    >>> rank_device("gloo")
    device(type='cpu')
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from placement.distributed.errors import WorldSizeError
from placement.distributed.ranks import RanksLike, format_groups, rank_groups
from placement.distributed.watchdog import Watchdog, guard
from placement.errors import InputError
from placement.graph.model import Model

__all__ = ["RankMember", "rank_device"]

log = logging.getLogger(__name__)

#: rank members built so far per (kind, group by global ranks): every rank counts alike,
#: so the n-th member built on each rank shares its heartbeat namespace with its peers
_instances: dict[tuple[str, tuple[int, ...]], itertools.count[int]] = {}

_Self = TypeVar("_Self", bound="RankMember")


def rank_device(backend: str | None = None) -> torch.device:
    """The physical device of this process: ``cuda:LOCAL_RANK`` under NCCL, else the CPU.

    Example:
        >>> rank_device("gloo")
        device(type='cpu')
    """
    backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


class RankMember:
    """This process as one rank of a placed model's pipeline (a base class).

    Attributes set by :meth:`_join_group`: ``group``, ``rank``, ``world_size``, ``groups``
    (logical devices per rank), ``device``, ``chunks``, ``grace``, ``input_names``,
    ``output_names`` and ``micro_batch`` (the graph's static batch size, or None).
    """

    group: Any
    rank: int
    world_size: int
    grace: float
    _dog: Watchdog | None

    def _join_group(
        self,
        model: Model | str | Path,
        *,
        kind: str,
        ranks: RanksLike,
        chunks: int | None,
        group: Any,
        device: str | torch.device | None,
        heartbeat: float,
        grace: float,
    ) -> Model:
        """Join ``group`` as this rank of ``model``'s placement; return the loaded model.

        ``kind`` names the heartbeat namespace (members of different kinds on one
        group never read each other's reports).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialized.
            WorldSizeError: the group size differs from the placement's number of ranks.
            InputError: a pipeline member is given a tensor-parallel split.
        """
        from placement.runtime.inputs import input_specs

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
        if not isinstance(model, Model):
            from placement.graph.loading import load

            model = load(model)
        if not kind.startswith("tp"):
            from placement.distributed.spmd import is_tensor_parallel

            if is_tensor_parallel(model):
                raise InputError(
                    "the model is split tensor-parallel (it has collectives): run it with "
                    "placement.distributed.DistributedTensorParallel (or DistributedTensorPipeline for "
                    "a split inside pipeline stages), one rank per device, not as a pipeline"
                )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.groups = rank_groups(model, ranks=ranks)
        if self.world_size != len(self.groups):
            raise WorldSizeError(
                world_size=self.world_size, expected=len(self.groups), groups=format_groups(self.groups)
            )
        self.device = torch.device(device) if device is not None else rank_device()
        self.chunks = chunks
        self.grace = grace
        self.input_names = list(model.inputs)
        self.output_names = list(model.outputs)
        self._specs = input_specs(model.graph)
        first = self._specs[0].shape if self._specs else ()
        self.micro_batch: int | None = first[0] if first and isinstance(first[0], int) else None
        self._peers = (
            [dist.get_global_rank(group, r) for r in range(self.world_size)]
            if group is not None
            else list(range(self.world_size))
        )
        members = tuple(self._peers)
        instance = next(_instances.setdefault((kind, members), itertools.count()))
        store = _default_store()
        self._dog = (
            Watchdog(
                store,
                rank=self.rank,
                world_size=self.world_size,
                interval=heartbeat,
                namespace=f"{kind}{'-'.join(map(str, members))}.{instance}/",
            )
            if store is not None
            else None
        )
        return model

    # -- public -------------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        """True on the rank that takes the graph inputs."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """True on the rank that returns the graph outputs (and the loss, when training)."""
        return self.rank == self.world_size - 1

    def report_failure(self, exc: BaseException) -> None:
        """Tell the other ranks that this rank fails with ``exc`` (they name it in their error)."""
        if self._dog is not None:
            self._dog.report(exc, own=True)

    def barrier(self) -> None:
        """Wait for every rank of the pipeline (raises RankFailedError naming a failed rank)."""
        with self._guard("barrier"):
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Stop this rank's heartbeat (the process group stays; destroy it yourself)."""
        if self._dog is not None:
            self._dog.stop()
            self._dog = None

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- for subclasses -------------------------------------------------------------------------

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Collective work named ``what``: a peer's failure becomes a RankFailedError naming it."""
        with guard(self._dog, what, grace=self.grace):
            yield

    def _micro_batches(self, chunks: int | None, rows: int | None, share: Callable[[int | None], int]) -> int:
        """How many micro-batches a run splits rank 0's batch into: the same on every rank.

        ``chunks`` (else the constructor's) wins; when the graph's batch is static it must
        make exactly ``rows`` (rank 0's rows; None where unknown, as on other ranks).
        Without it rank 0 divides its rows by the graph's batch (one micro-batch when that
        is not static) and ``share`` hands its count (None on other ranks) to every rank.

        Raises:
            InputError: ``chunks`` micro-batches of the graph's batch are not ``rows`` rows.
        """
        n = chunks or self.chunks
        if n is not None:
            if self.micro_batch and rows is not None and rows != int(n) * self.micro_batch:
                raise InputError(
                    f"chunks={n} micro-batches of the graph's batch {self.micro_batch} make "
                    f"{int(n) * self.micro_batch} rows, but input {self.input_names[0]!r} has {rows}"
                )
            return int(n)
        counted = None
        if self.is_first:
            counted = rows // self.micro_batch if self.micro_batch and rows is not None else 1
        return share(counted)

    def _check_inputs(self, inputs: Any) -> list[np.ndarray]:
        """Rank 0's graph inputs as arrays, any multiple of the graph's batch size in rows.

        Raises:
            InputError: no inputs, bad names, dtypes or dimensions, or rows that are not
                a multiple of the graph's batch (the message names the input).
        """
        from placement.runtime.inputs import InputSpec, normalize_inputs

        if inputs is None:
            raise InputError(f"rank 0 needs the graph inputs ({', '.join(map(repr, self.input_names))})")
        # any number of rows: the batch dimension is checked against the micro-batch below
        specs = [
            InputSpec(s.name, s.dtype, (None, *s.shape[1:]) if s.shape else s.shape) for s in self._specs
        ]
        arrays = normalize_inputs(inputs, specs)
        if self.micro_batch is not None:
            for spec, array in zip(self._specs, arrays):
                rows = array.shape[0] if array.ndim else 0
                if rows % self.micro_batch or rows == 0:
                    raise InputError(
                        f"input {spec.name!r} has {rows} rows; the placed graph's batch is "
                        f"{self.micro_batch}, so give a multiple of it (one micro-batch each)"
                    )
        return arrays


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as err:  # a process group without a store: failures are not diagnosed
        log.debug("no store for failure reports: %s", err)
        return None
