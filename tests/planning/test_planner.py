"""Tests for ``pl.auto_place`` and ``Plan``: exactness against brute force, budgets, JSON."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement as pl
from placement.planning.fusion import find_chains, fusion_cut_costs
from placement.planning.graph_info import GraphInfo
from placement.planning.link_model import Link, Links
from placement.planning.partition import PartitionProblem
from placement.planning.planner import build_plan
from tests.planning.helpers import (
    all_ends,
    assert_matches_torch,
    devices_by_op,
    random_dag,
)


def _brute_force(info, costs, budgets, allowed=None):
    """Lexicographic optimum (bottleneck, bytes copied) and optimum (bytes, bottleneck)."""
    n, parts = len(info), len(budgets)
    best_tp = best_lat = None
    for ends in all_ends(n, parts):
        if allowed is not None and not all(allowed[e] for e in ends):
            continue
        start, ok, bottleneck = 0, True, 0
        part = [0] * n
        for k, end in enumerate(ends):
            if budgets[k] is not None and info.segment_memory(start, end) > budgets[k]:
                ok = False
                break
            bottleneck = max(bottleneck, sum(costs[start:end]))
            for pos in range(start, end):
                part[pos] = k
            start = end
        if not ok:
            continue
        transfer = sum(info.transfers(part, parts)[1])
        if best_tp is None or (bottleneck, transfer) < best_tp:
            best_tp = (bottleneck, transfer)
        if best_lat is None or (transfer, bottleneck) < best_lat:
            best_lat = (transfer, bottleneck)
    return best_tp, best_lat


def _solve(info, costs, budgets, objective, allowed=None):
    problem = PartitionProblem(costs, budgets, info, allowed_cuts=allowed)
    bound = problem.min_bottleneck() if objective == "throughput" else None
    ends = problem.min_transfer(bound)
    devices = [pl.Device("cuda", k) for k in range(len(budgets))]
    return build_plan(info, costs, ends, devices, budgets, cost_kind="size", objective=objective)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_ops=st.integers(1, 12),
    parts=st.integers(1, 3),
    data=st.data(),
)
def test_planner_matches_brute_force_on_small_graphs(seed, n_ops, parts, data):
    model = random_dag(seed, n_ops)
    info = GraphInfo(model)
    costs = data.draw(st.lists(st.integers(0, 20), min_size=len(info), max_size=len(info)))
    whole = info.segment_memory(0, len(info))
    budgets = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, whole + 10)), min_size=parts, max_size=parts)
    )
    allowed = data.draw(st.none() | st.lists(st.booleans(), min_size=len(info) + 1, max_size=len(info) + 1))
    if allowed is not None:
        allowed[0] = allowed[-1] = True
    best_tp, best_lat = _brute_force(info, costs, budgets, allowed)
    if best_tp is None:
        with pytest.raises(pl.InfeasiblePlacementError):
            _solve(info, costs, budgets, "throughput", allowed)
        return
    plan = _solve(info, costs, budgets, "throughput", allowed)
    assert (plan.bottleneck, plan.transfer_bytes) == best_tp
    assert plan.fits
    plan = _solve(info, costs, budgets, "latency", allowed)
    assert (plan.transfer_bytes, plan.bottleneck) == best_lat
    assert plan.fits


@pytest.mark.parametrize("name", ["mlp", "resnet"])
@pytest.mark.parametrize("parts", [2, 3])
def test_planner_matches_brute_force_on_zoo_models(exported, name, parts):
    model, _, _ = exported(name)
    info = GraphInfo(model)
    costs = pl.profile(model, time=False).costs("flops")
    best_tp, _ = _brute_force(info, costs, [None] * parts)
    plan = _solve(info, costs, [None] * parts, "throughput")
    assert (plan.bottleneck, plan.transfer_bytes) == best_tp


def test_auto_place_time_on_gpt_keeps_outputs(exported):
    model, net, args = exported("gpt")
    plan = pl.auto_place(model, devices=2, repeats=2)
    assert plan.cost_kind == "time"
    assert devices_by_op(model) == plan.assignment
    assert {str(d) for d in model.devices} == {"cuda:0", "cuda:1"}
    assert plan.bottleneck >= plan.lower_bound
    assert plan.transfer_bytes > 0 and len(plan.cut_bytes) == 1
    assert_matches_torch(model, net, args)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_auto_place_respects_budgets(exported, name):
    model, net, args = exported(name)
    info = GraphInfo(model)
    whole = info.segment_memory(0, len(info))
    smallest = PartitionProblem([0] * len(info), [whole] * 3, info).min_uniform_budget()
    assert smallest < whole  # three devices need less than one
    budget = max(int(whole * 0.6), smallest)
    plan = pl.auto_place(model, max_memory={0: budget, 1: budget, 2: budget}, cost="flops")
    assert plan.fits
    placed = model.copy()
    pl.inject_cross_device_copies(placed)
    for row in pl.summary(placed).rows:  # the applied placement, measured by the report
        assert row.param_bytes + row.static_copy_bytes + row.peak_activation_bytes <= budget
    assert_matches_torch(model, net, args)


def test_infeasible_budget_states_smallest_uniform_budget(exported):
    model, _, _ = exported("gpt")
    before = devices_by_op(model)
    with pytest.raises(pl.InfeasiblePlacementError) as err:
        pl.auto_place(model, max_memory={0: "10KB", 1: "10KB"}, cost="size")
    message = str(err.value)
    assert "smallest uniform budget that fits" in message and "needs at least" in message
    assert devices_by_op(model) == before  # unchanged
    smallest = int(message.split("(")[-1].split(" bytes")[0])
    plan = pl.auto_place(model, max_memory={0: smallest, 1: smallest}, cost="size")
    assert plan.fits
    with pytest.raises(pl.InfeasiblePlacementError):
        pl.auto_place(model, max_memory={0: smallest - 1, 1: smallest - 1}, cost="size")


def test_no_cut_right_after_a_parameter_only_op(exported):
    model, _, _ = exported("gpt")
    info = GraphInfo(model)
    constant = [pos for pos in range(len(info)) if not info.data_dependent[pos]]
    assert any(info.nodes[pos].op_type == "Transpose" for pos in constant)  # weight transposes
    for parts in (2, 3, 4):
        plan = pl.auto_place(model, devices=parts, cost="flops")
        names = [op.name for op in model.ops]
        for pos in constant:
            assert plan.assignment[names[pos]] == plan.assignment[names[pos + 1]]


def test_tied_embedding_counts_on_every_device_reading_it(exported):
    model, _, _ = exported("gpt")
    plan = pl.auto_place(model, devices=2, cost="flops")
    tied = model.parameters["lm_head.weight"].nbytes
    total = sum(p.nbytes for p in model.parameters.values())
    held = sum(d.param_bytes for d in plan.devices)
    assert held >= total + tied  # wte (first device) and lm_head (last device) both hold it


def test_latency_objective_keeps_one_device_when_it_fits(exported):
    model, _, _ = exported("resnet")
    plan = pl.auto_place(model, devices=3, cost="flops", objective="latency")
    assert plan.transfer_bytes == 0
    assert [str(d) for d in model.devices] == ["cuda:0"]


def test_auto_place_argument_errors(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlanError, match="unknown cost"):
        pl.auto_place(model, devices=2, cost="watts")
    with pytest.raises(pl.PlanError, match="objective"):
        pl.auto_place(model, devices=2, objective="fast")
    with pytest.raises(pl.PlanError):
        pl.auto_place(model)
    with pytest.raises(pl.PlanError, match="not among devices"):
        pl.auto_place(model, devices=2, max_memory={5: "1GB"})
    with pytest.raises(pl.PlanError, match="bad memory size"):
        pl.auto_place(model, max_memory={0: "lots"})
    with pytest.raises(pl.DeviceError):
        pl.auto_place(model, devices=["tpu:0"])


def test_auto_place_refuses_models_with_copies(exported):
    model, _, _ = exported("mlp")
    pl.balance(model, [2, 3])
    pl.inject_cross_device_copies(model)
    with pytest.raises(pl.PlanError, match="copies"):
        pl.auto_place(model, devices=2, cost="size")


@pytest.mark.parametrize("devices", [1.5, "cuda:0", b"2", object()])
def test_auto_place_rejects_devices_that_are_neither_a_count_nor_a_list(exported, devices):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlanError, match="count or a list"):
        pl.auto_place(model, devices=devices, cost="size")


def test_time_cost_falls_back_to_flops_when_timing_would_not_fit(exported, monkeypatch, caplog):
    from placement.planning import planner

    model, _, _ = exported("mlp")
    monkeypatch.setattr(planner, "_available_memory", lambda: 1024)  # a machine with 1 KiB free
    with caplog.at_level("WARNING", logger="placement.planning.planner"):
        plan = pl.auto_place(model, devices=2)
    assert plan.cost_kind == "flops"
    assert "cost='flops' instead" in caplog.text


def _brute_force_timed(info, costs, budgets, devices, links, cuts):
    """Lexicographic optima (bottleneck, overhead) and (overhead, bottleneck) under links and cut costs."""
    n, parts = len(info), len(budgets)
    best_tp = best_lat = None
    for ends in all_ends(n, parts):
        start, ok = 0, True
        for k, end in enumerate(ends):
            if budgets[k] is not None and info.segment_memory(start, end) > budgets[k]:
                ok = False
                break
            start = end
        if not ok:
            continue
        plan = build_plan(
            info, costs, ends, devices, budgets, cost_kind="time", objective="x", links=links, cut_costs=cuts
        )
        if best_tp is None or (plan.bottleneck, plan.overhead) < best_tp:
            best_tp = (plan.bottleneck, plan.overhead)
        if best_lat is None or (plan.overhead, plan.bottleneck) < best_lat:
            best_lat = (plan.overhead, plan.bottleneck)
    return best_tp, best_lat


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_ops=st.integers(1, 11), parts=st.integers(1, 3), data=st.data())
def test_planner_with_links_and_cut_costs_matches_brute_force(seed, n_ops, parts, data):
    """Exact when all links into a device are alike: each device gets its own incoming link."""
    model = random_dag(seed, n_ops)
    info = GraphInfo(model)
    n = len(info)
    costs = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    cuts = data.draw(
        st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), min_size=n + 1, max_size=n + 1)
    )
    whole = info.segment_memory(0, n)
    budgets = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, whole + 10)), min_size=parts, max_size=parts)
    )
    devices = [pl.Device("cuda", k) for k in range(parts)]
    incoming = [
        Link(
            bandwidth=data.draw(st.sampled_from([1e9, 4e9, 1e10])),
            latency=data.draw(st.sampled_from([0, 5e-9, 3e-8])),
        )
        for _ in range(parts)
    ]
    links = Links({(devices[s], devices[k]): incoming[k] for k in range(1, parts) for s in range(k)})
    assert links.uniform_into(devices)
    best_tp, best_lat = _brute_force_timed(info, costs, budgets, devices, links, cuts)
    links_in = [links.link(devices[max(k - 1, 0)], devices[k]) for k in range(parts)]
    problem = PartitionProblem(costs, budgets, info, links_in=links_in, cut_costs=cuts)
    if best_tp is None:
        with pytest.raises(pl.InfeasiblePlacementError):
            problem.min_bottleneck()
        return
    for objective, best in (("throughput", best_tp), ("latency", best_lat)):
        bound = problem.min_bottleneck() if objective == "throughput" else None
        ends = problem.min_transfer(bound)
        plan = build_plan(
            info,
            costs,
            ends,
            devices,
            budgets,
            cost_kind="time",
            objective=objective,
            links=links,
            cut_costs=cuts,
        )
        got = (
            (plan.bottleneck, plan.overhead)
            if objective == "throughput"
            else (plan.overhead, plan.bottleneck)
        )
        assert got == best
        assert plan.fits


def test_auto_place_with_links_counts_transfer_time(exported):
    model, net, args = exported("gpt")
    plan = pl.auto_place(model, devices=2, repeats=2, links="pcie", fusion=False)
    assert plan.links is not None and len(plan.cut_bytes) == 1
    pcie = Links(default="pcie").link("cuda:0", "cuda:1")
    info = GraphInfo(model)
    expected = sum(pcie.time_ns(info.step_bytes[b]) for b in info.blobs_into(plan.devices[0].ops, len(info)))
    assert plan.devices[1].transfer_time == expected > 0
    assert plan.bottleneck == max(d.cost + d.transfer_time for d in plan.devices)
    assert plan.overhead == expected
    assert_matches_torch(model, net, args)


def test_auto_place_keeps_one_device_when_links_are_slow(exported):
    model, _, _ = exported("mlp")
    plan = pl.auto_place(model, devices=2, repeats=2, links=Link(bandwidth=1e3, latency=1.0))
    assert {str(d) for d in model.devices} == {"cuda:0"}
    assert plan.devices[1].ops == 0 and plan.overhead == 0


def test_auto_place_link_arguments(exported):
    model, _, _ = exported("mlp")
    with pytest.raises(pl.PlanError, match="cost='time'"):
        pl.auto_place(model, devices=2, cost="flops", links="pcie")
    with pytest.raises(pl.PlanError, match="unknown link"):
        pl.auto_place(model, devices=2, links="carrier-pigeon")
    with pytest.raises(pl.PlanError, match="bandwidth"):
        Link(bandwidth=0)
    plan = pl.auto_place(model, devices=2, cost="flops")  # "auto" links are ignored for non-time costs
    assert plan.links is None and plan.overhead == 0


def test_fusion_chains_and_cut_costs_on_resnet(exported):
    model, _, _ = exported("resnet")
    info = GraphInfo(model)
    chains = find_chains(info)
    assert chains and all(info.nodes[a].op_type == "Conv" for a, _ in chains)
    cuts = fusion_cut_costs(model, info, repeats=3)
    inside = {c for a, b in chains for c in range(a + 1, b)} | {b for _, b in chains}  # and boundaries
    assert all(cuts[c] == (0, 0) for c in range(len(info) + 1) if c not in inside)
    assert all(before >= after >= 0 for before, after in cuts)


@pytest.mark.parametrize("add_inputs", [("b", "skip"), ("skip", "b")])
def test_a_chain_interleaved_with_a_skip_branch_is_kept_whole(add_inputs, exported):
    """An exporter may compute a residual block's skip branch between the BatchNormalization
    and the Add. ONNX Runtime's blocked-layout convolution still takes the Add (and the Relu)
    into the convolution making the Add's *first* input (checked on its optimised graph),
    whichever comes first in the order: no cut may fall inside that chain."""
    import numpy as np
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from placement.planning.fusion import fused_cuts

    rng = np.random.default_rng(0)
    weights = {"w1": rng.random((8, 8, 3, 3)), "w2": rng.random((8, 8, 1, 1))}
    weights |= {n: rng.random(8) + 0.5 for n in ("scale", "bias", "mean", "var")}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"], name="bn"),
            helper.make_node("Conv", ["y", "w2"], ["skip"], name="skip_conv"),
            helper.make_node("Add", list(add_inputs), ["s"], name="add"),
            helper.make_node("Relu", ["s"], ["r"], name="relu"),
        ],
        "block",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 8, 8]) for n in "xy"],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a.astype(np.float32), n) for n, a in weights.items()],
    )
    model = pl.Model(ir.serde.deserialize_model(helper.make_model(graph)))
    info = GraphInfo(model)
    assert find_chains(info) == [(0, 2), (2, 5)]  # adjacent only: the skip conv seems to own the Add
    if add_inputs[0] == "b":  # ORT folds the Add into the BatchNormalization's convolution
        assert find_chains(info, adjacent=False) == [(0, 5)]
        assert fused_cuts(model, info) == [True, False, False, False, False, True]
    else:  # into the skip convolution, as the adjacent chains say
        assert find_chains(info, adjacent=False) == [(0, 2), (2, 5)]
        assert fused_cuts(model, info) == [True, False, True, False, False, True]
    # the zoo's ResNet exports each block's ops in chain order: nothing changes there
    resnet_info = GraphInfo(exported("resnet")[0])
    assert find_chains(resnet_info, adjacent=False) == find_chains(resnet_info)


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_fused_groups_are_never_cut(exported, name):
    """``runtime="ort"`` reads ONNX Runtime's optimised graph: a blob it fuses away
    (Conv -> BatchNormalization, Add -> Gelu as BiasGelu, MatMul -> Mul as FusedMatMul)
    never crosses a part boundary, whatever the op costs say."""
    from placement.planning.fusion import fused_cuts

    model, net, args = exported(name)
    info = GraphInfo(model)
    allowed = fused_cuts(model, info)
    assert allowed[0] and allowed[-1] and not all(allowed)
    for a, b in find_chains(info):
        assert not any(allowed[a + 1 : b])
    # costs that pull the cut into every forbidden position in turn: the plan moves off it
    forbidden = [c for c in range(1, len(info)) if not allowed[c]][:: max(1, len(info) // 12)]
    for c in forbidden:
        costs = {n: 1.0 for n in info.names}
        costs[info.names[c - 1]] = costs[info.names[c]] = 10.0**6
        plan = pl.auto_place(model, devices=2, repeats=1, op_costs=costs, links=None)
        assert plan.runtime == "ort"
        ends = [sum(d.ops for d in plan.devices[: k + 1]) for k in range(len(plan.devices))]
        assert all(allowed[e] for e in ends)
    assert_matches_torch(model, net, args)


def test_runtime_torch_is_the_op_by_op_plan(exported):
    model, _, _ = exported("mlp")
    plan = pl.auto_place(model, devices=2, repeats=1, runtime="torch", fusion=False)
    assert plan.runtime == "torch" and pl.Plan.from_json(plan.to_json()) == plan
    assert plan.total_cost == sum(pl.profile(model, repeats=1).costs("time"))
    with pytest.raises(pl.PlanError, match="unknown runtime"):
        pl.auto_place(model, devices=2, runtime="tensorrt")


def test_op_costs_override_the_profile(exported):
    model, _, _ = exported("mlp")
    names = [op.name for op in model.ops]
    costs = {n: 1.0 for n in names}
    costs[names[-1]] = 100.0
    plan = pl.auto_place(model, devices=2, op_costs=costs, links=None, fusion=False)
    assert plan.devices[1].ops == 1 and plan.bottleneck == 100
    with pytest.raises(pl.UnknownOpError, match="no_such_op"):
        pl.auto_place(model, devices=2, op_costs={"no_such_op": 1.0})
    with pytest.raises(pl.PlanError, match="non-negative"):
        pl.auto_place(model, devices=2, op_costs={names[0]: -1.0})
