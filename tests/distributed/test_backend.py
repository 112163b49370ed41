"""The launcher's backend choice for any number of GPUs, with faked GPU counts."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.distributed.backend import choose_backend, uses_nccl


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_no_gpu_is_gloo_on_the_cpu(ranks):
    for rank in range(ranks):
        choice = choose_backend(None, local_rank=rank, local_world_size=ranks, n_gpus=0)
        assert (choice.backend, choice.device, choice.note) == ("gloo", torch.device("cpu"), None)
    with pytest.raises(pl.DeviceError, match="none"):
        choose_backend("nccl", local_rank=0, local_world_size=2, n_gpus=0)


@pytest.mark.parametrize(("ranks", "gpus"), [(1, 1), (2, 2), (2, 4), (4, 8)])
def test_a_gpu_per_rank_is_nccl_on_its_own_gpu(ranks, gpus):
    choices = [choose_backend(None, local_rank=r, local_world_size=ranks, n_gpus=gpus) for r in range(ranks)]
    assert {c.backend for c in choices} == {"nccl"}
    assert [c.device for c in choices] == [torch.device("cuda", r) for r in range(ranks)]
    assert not any(c.note or c.host_transfers for c in choices)


@pytest.mark.parametrize(
    ("ranks", "gpus", "devices"),
    [(2, 1, [0, 0]), (3, 1, [0, 0, 0]), (4, 2, [0, 0, 1, 1]), (3, 2, [0, 0, 1])],
)
def test_more_ranks_than_gpus_is_gloo_through_host_memory(ranks, gpus, devices):
    choices = [choose_backend(None, local_rank=r, local_world_size=ranks, n_gpus=gpus) for r in range(ranks)]
    assert {c.backend for c in choices} == {"gloo"}
    assert [c.device.index for c in choices] == devices and all(c.host_transfers for c in choices)
    note = choices[0].note
    assert note is not None and "\n" not in note and "host memory" in note and f"{ranks} ranks" in note
    with pytest.raises(pl.DeviceError, match=f"{ranks} ranks on this node, {gpus} GPU"):
        choose_backend("nccl", local_rank=0, local_world_size=ranks, n_gpus=gpus)


def test_explicit_gloo_and_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    choice = choose_backend()
    assert choice.backend == "gloo" and choice.device == torch.device("cuda", 0) and choice.note
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_backend().backend == "nccl" and choose_backend().device == torch.device("cuda", 1)
    kept = choose_backend("gloo")
    assert kept.backend == "gloo" and kept.host_transfers


def test_cpu_tensors_never_use_nccl():
    assert not uses_nccl(torch.device("cpu"))
    assert not uses_nccl(torch.device("cuda", 0))  # no process group here
