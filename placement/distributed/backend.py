"""Which ``torch.distributed`` backend and device a rank uses, for any number of GPUs.

NCCL needs one GPU per rank: two ranks of one node on the same GPU fail at the first
collective ("Duplicate GPU detected"). So :func:`choose_backend` picks

* **no GPU**: gloo, every rank on the CPU;
* **a GPU per rank** (local ranks <= GPUs): NCCL, local rank ``r`` on ``cuda:r``;
  activations move GPU to GPU;
* **more local ranks than GPUs**: gloo; the ranks share the GPUs in order (contiguous
  runs, as ``device_map="auto"`` shares them among logical devices) and their
  activations cross ranks through host memory. :attr:`BackendChoice.note` says so in
  one line, which ``placement.launch`` prints once (rank 0).

A backend asked for explicitly is kept, except NCCL where it cannot work (no GPU, or
ranks sharing one): that is a :class:`~placement.errors.DeviceError` naming the counts.
Under gloo a rank that computes on a GPU still sends and receives host tensors
(:func:`uses_nccl` tells the runners which).

Example:
    >>> choose_backend(None, local_rank=1, local_world_size=2, n_gpus=2)
    BackendChoice(backend='nccl', device=device(type='cuda', index=1), note=None)
    >>> choice = choose_backend(None, local_rank=1, local_world_size=2, n_gpus=1)
    >>> choice.backend, str(choice.device)
    ('gloo', 'cuda:0')
    >>> print(choice.note)  # doctest: +ELLIPSIS
    placement.launch: 2 ranks on 1 GPU(s): gloo, ranks share GPUs (rank 0 -> cuda:0, ...); ... host memory
    >>> choose_backend(None, local_rank=0, local_world_size=2, n_gpus=0).backend
    'gloo'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from placement.errors import DeviceError

__all__ = ["BackendChoice", "choose_backend", "uses_nccl"]


@dataclass(frozen=True)
class BackendChoice:
    """A rank's backend (``"nccl"`` or ``"gloo"``), its compute device, and the line to print
    (None when there is nothing to say)."""

    backend: str
    device: torch.device
    note: str | None = None

    @property
    def host_transfers(self) -> bool:
        """Whether activations cross ranks through host memory while the rank computes on a GPU."""
        return self.device.type == "cuda" and self.backend != "nccl"


def _gpu_of(local_rank: int, local_world_size: int, n_gpus: int) -> int:
    return local_rank * n_gpus // max(local_world_size, 1)


def choose_backend(
    requested: str | None = None,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    n_gpus: int | None = None,
) -> BackendChoice:
    """The backend and device of this rank (see the module docstring).

    Args:
        requested: ``"nccl"``, ``"gloo"`` or None (choose).
        local_rank: this process's rank on its node (default ``$LOCAL_RANK``, else 0).
        local_world_size: ranks on this node (default ``$LOCAL_WORLD_SIZE``, else
            ``$WORLD_SIZE``, else 1).
        n_gpus: GPUs this process sees (default ``torch.cuda.device_count()``).

    Raises:
        DeviceError: NCCL asked for without a GPU per rank.
    """
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if local_world_size is None:
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = requested.strip().lower() if requested else None
    if name is not None and name not in ("nccl", "gloo"):
        return BackendChoice(name, torch.device("cpu"))  # another backend: the user's business
    if n_gpus == 0:
        if name == "nccl":
            raise DeviceError("--backend nccl needs GPUs, and this process sees none; use gloo")
        return BackendChoice("gloo", torch.device("cpu"))
    if local_world_size <= n_gpus:
        return BackendChoice(name or "nccl", torch.device("cuda", local_rank))
    if name == "nccl":
        raise DeviceError(
            f"--backend nccl needs a GPU per rank: {local_world_size} ranks on this node, {n_gpus} GPU(s); "
            "use gloo (ranks share GPUs, activations through host memory) or fewer ranks per node"
        )
    shares = ", ".join(
        f"rank {r} -> cuda:{_gpu_of(r, local_world_size, n_gpus)}" for r in range(local_world_size)
    )
    note = (
        f"placement.launch: {local_world_size} ranks on {n_gpus} GPU(s): gloo, ranks share GPUs "
        f"({shares}); activations cross ranks through host memory"
    )
    return BackendChoice("gloo", torch.device("cuda", _gpu_of(local_rank, local_world_size, n_gpus)), note)


def uses_nccl(device: torch.device, group: Any = None) -> bool:
    """Whether tensors to and from other ranks may stay on ``device``: it is a GPU and the
    process group's backend is NCCL (gloo moves host tensors).

    Example:
        >>> uses_nccl(torch.device("cpu"))
        False
    """
    if device.type != "cuda":
        return False
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower()
