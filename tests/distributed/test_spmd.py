"""One rank's share of a tensor-parallel split (in one process: no ranks are started)."""

from __future__ import annotations

import argparse

import pytest
import torch

import placement as pl
from placement.distributed.spmd import is_tensor_parallel, local_ops, split_spmd, spmd_devices
from tests.conftest import export_once


def _split_mlp(devices=(0, 1)) -> pl.Model:
    model = export_once("mlp")[0].copy()  # exported once per test session
    pl.split_tensor_parallel(model, devices=list(devices))
    return model


def test_each_rank_keeps_its_device_and_one_call_per_collective():
    model = _split_mlp()
    module = pl.to_torch(model, device_map="cpu")
    stages = [split_spmd(module, model, rank=r) for r in range(2)]
    for rank, stage in enumerate(stages):
        assert [(c.kind, c.id, c.index) for c in stage.collectives] == [
            ("all_reduce", 0, rank),
            ("all_gather", 1, rank),
        ]
        params = dict(stage.module.named_parameters())
        assert all(".tp" not in name or name.endswith(f".tp{rank}") for name in params)  # its own shards only
        assert "fc2.bias" in "".join(params) or rank == 1  # the bias after the reduce: where the outputs are
        assert stage.copy_ins == 2  # Megatron's f: into the column-parallel fc1 and fc3
    assert [s.holds_outputs for s in stages] == [True, False]
    assert [c.dangling for c in stages[1].collectives] == [False, True]  # only rank 0 reads the logits
    assert stages[1].collectives[1].sizes == [4, 4]


def test_local_values_are_the_shards_and_what_reads_them():
    model = _split_mlp()
    ops, inits = local_ops(model, ["cuda:0", "cuda:1"])
    assert inits == {n for n in model.graph.initializers if ".tp" in n}
    assert {"node_relu.tp0", "node_relu.tp1"} <= ops
    collectives = {n.name for n in model.graph if n.op_type in ("Sum", "Concat")}
    assert not ops & collectives  # a collective's result is the same on every device


def test_a_value_crossing_devices_outside_a_collective_is_named():
    model = _split_mlp()
    relu = next(n for n in model.graph if n.name == "node_relu_1.tp1")
    copy = next(n for n in model.graph if n.name == "copy_linear_1.tp0_cuda_1")
    relu.replace_input_with(0, copy.outputs[0])  # device 1 reads device 0's partial, not the all-reduce
    module = pl.to_torch(model, device_map="cpu")
    with pytest.raises(pl.PlacementError, match="outside a collective"):
        split_spmd(module, model, rank=1)


def test_a_model_without_collectives_is_not_run_as_tensor_parallel_ranks():
    model = export_once("mlp")[0]
    assert not is_tensor_parallel(model)
    with pytest.raises(pl.PlacementError, match="0 device groups"):
        spmd_devices(model)
    assert is_tensor_parallel(_split_mlp())


def test_one_rank_world_is_refused_naming_both_sizes():
    import torch.distributed as dist

    from placement.distributed import DistributedTensorParallel, WorldSizeError, free_port

    model = _split_mlp()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(WorldSizeError, match="2"):
            DistributedTensorParallel(model)
    finally:
        dist.destroy_process_group()


def test_launch_refuses_micro_batches_and_rank_groups_for_a_split(tmp_path):
    from placement.launch import _rank_runner, build_parser

    path = tmp_path / "mlp_tp2.onnx"
    _split_mlp().save(path)
    for extra, match in ((["--chunks", "2"], "no --chunks"), (["--ranks", "0,1"], "no --chunks or --ranks")):
        args: argparse.Namespace = build_parser().parse_args([str(path), *extra])
        with pytest.raises(pl.InputError, match=match):
            _rank_runner(args, torch.device("cpu"), None)


def test_pipeline_runners_refuse_a_split_naming_the_tensor_parallel_one():
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, DistributedRunner, free_port

    model = _split_mlp()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for runner in (DistributedPipeline, DistributedRunner):
            with pytest.raises(pl.InputError, match="DistributedTensorParallel"):
                runner(model)
    finally:
        dist.destroy_process_group()


def test_ort_rank_plans_issue_the_collectives_in_id_order_between_stages():
    from placement.distributed import tensor_rank_plan

    model = _split_mlp((0, 1, 2))
    for rank in range(3):
        plan = tensor_rank_plan(model, rank)
        assert [s[1] for s in plan.steps if s[0] == "collective"] == [0, 1]
        assert plan.steps[0][0] == "stage" and all(
            s[1].device == plan.device for s in plan.steps if s[0] == "stage"
        )
        kinds = {k: c.kind for k, c in plan.collectives.items()}
        assert kinds == {0: "all_reduce", 1: "all_gather"} and plan.collectives[1].sizes == [3, 3, 2]
        assert bool(plan.outputs) == (rank == 0)
        # rank 0's Sum reads its all-reduced partial and negative zeros in the others' slots
        if rank == 0:
            slots = sorted(v for v in plan.sources.values() if v[0] in ("reduced", "zeros"))
            assert slots == [("reduced", 0), ("zeros", 0), ("zeros", 0)]
