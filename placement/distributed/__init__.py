"""Run a placed model's stages as ``torch.distributed`` ranks (``torch.distributed.pipelining``).

What this package holds:

* :mod:`~placement.distributed.ranks`: which logical devices each rank runs
  (default one per rank, in pipeline order; ``ranks="cuda:0+cuda:1,cuda:2"`` groups them).
* :mod:`~placement.distributed.member`: :class:`RankMember`, what every rank-side runner
  shares (joining the group as one rank of the placement, input checks, the heartbeat).
* :mod:`~placement.distributed.split`: the lowered model (:func:`placement.to_torch`)
  cut into a chain of ``torch.fx`` stage modules, one per rank.
* :mod:`~placement.distributed.torch_ranks`: :class:`DistributedPipeline`, this rank's
  stage as a ``torch.distributed.pipelining.PipelineStage`` run by ``ScheduleGPipe`` or
  ``Schedule1F1B`` for inference and training.
* :mod:`~placement.distributed.ort_ranks`: :class:`DistributedRunner`, the same ranks on
  ONNX Runtime for inference (each rank runs its stage sessions; activations cross
  ranks with ``torch.distributed`` send/recv): a placed ONNX served without model code.
* :mod:`~placement.distributed.spmd` and :mod:`~placement.distributed.tensor_ranks`:
  :class:`DistributedTensorParallel`, a tensor-parallel split (:func:`placement.split_tensor_parallel`)
  run SPMD, one device per rank, each tagged collective one ``torch.distributed``
  all-reduce or all-gather (:mod:`~placement.distributed.collectives`, Megatron's f and g
  in training); :mod:`~placement.distributed.ort_tensor_ranks`:
  :class:`DistributedTensorParallelRunner`, the same on ONNX Runtime (inference).
* :mod:`~placement.distributed.grid` and :mod:`~placement.distributed.tensor_pipeline`:
  :class:`DistributedTensorPipeline`, a 2D split (tensor parallelism inside pipeline
  stages, ``devices=[[0, 1], [2, 3]]``) as a grid of ranks: each group's collectives over its
  own process group, the stages a ``torch.distributed.pipelining`` pipeline per chain.
* :mod:`~placement.distributed.watchdog`: heartbeats and error reports in the rendezvous
  store, so that the surviving ranks name the rank that failed.
* :mod:`~placement.distributed.errors`: :class:`WorldSizeError`, :class:`RankFailedError`,
  :class:`NotAPipelineError` (all :class:`placement.PlacementError`).

The command-line entry point is ``torchrun --nproc-per-node N -m placement.launch placed.onnx``
(:mod:`placement.launch`), or ``placement launch`` which runs torchrun for you.

Importing this package imports ``torch`` (and ``torch.distributed``); ``import placement``
does not import it.

May import: ``placement.errors``, ``graph``, ``analysis``, ``passes``, ``planning``, ``runtime``.

Example:
    >>> from placement.distributed import DistributedPipeline, rank_groups
    >>> DistributedPipeline.__name__
    'DistributedPipeline'
"""

from __future__ import annotations

from placement.distributed.errors import NotAPipelineError, RankFailedError, WorldSizeError
from placement.distributed.ort_ranks import DistributedRunner, rank_plan
from placement.distributed.ort_tensor_ranks import DistributedTensorParallelRunner, tensor_rank_plan
from placement.distributed.ranks import format_groups, pipeline_devices, rank_groups
from placement.distributed.split import RankSplit, split_by_rank
from placement.distributed.spmd import SpmdStage, split_spmd
from placement.distributed.tensor_pipeline import DistributedTensorPipeline
from placement.distributed.tensor_ranks import DistributedTensorParallel
from placement.distributed.torch_ranks import SCHEDULES, DistributedPipeline, free_port, rank_device

__all__ = [
    "DistributedPipeline",
    "DistributedRunner",
    "DistributedTensorParallel",
    "DistributedTensorPipeline",
    "DistributedTensorParallelRunner",
    "tensor_rank_plan",
    "split_spmd",
    "SpmdStage",
    "rank_plan",
    "SCHEDULES",
    "rank_device",
    "free_port",
    "rank_groups",
    "pipeline_devices",
    "format_groups",
    "split_by_rank",
    "RankSplit",
    "WorldSizeError",
    "RankFailedError",
    "NotAPipelineError",
]
