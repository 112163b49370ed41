"""Tests for ``placement.passes.shift``: label propagation, pairs, swaps, errors, transactions."""

from __future__ import annotations

import logging

import pytest

import placement as pl
from placement.passes import ShiftActivationDevicesPass
from tests.passes.helpers import (
    GraphBuilder,
    assert_same_outputs,
    chain,
    check_copies,
    devices_of,
    feeds_for,
    run_ort,
    snapshot,
)


def test_chain_second_half_shifted() -> None:
    model = chain(8)
    acts = pl.get_activation_blobs(model)
    result = pl.shift_activation_devices(model, acts[4:], {0: 1})
    assert list(devices_of(model).values()) == ["cuda:0"] * 4 + ["cuda:1"] * 4
    assert result.modified and result.total == 4
    assert result.moved == {(pl.Device("cuda", 0), pl.Device("cuda", 1)): 4}
    assert str(result) == "4 ops cuda:0 -> cuda:1"


@pytest.mark.parametrize(
    "shifts",
    [{0: 1}, {"cuda:0": "cuda:1"}, {pl.Device("cuda", 0): pl.Device("cuda", 1)}, {"0": 1}, {0: "gpu:1"}],
)
def test_device_spellings(shifts) -> None:
    model = chain(4)
    pl.shift_activation_devices(model, ["h2", "h3"], shifts)
    assert list(devices_of(model).values()) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_cpu_target_and_source() -> None:
    model = chain(4)
    pl.shift_activation_devices(model, ["h3"], {0: "cpu"})
    assert devices_of(model)["op3"] == "cpu"
    pl.shift_activation_devices(model, ["h3"], {"cpu": 2})
    assert devices_of(model)["op3"] == "cuda:2"


def test_two_pairs_at_once() -> None:
    model = chain(8, devices=[0, 0, 0, 0, 1, 1, 1, 1])
    pl.shift_activation_devices(model, ["h2", "h3", "h6", "h7"], {0: 2, 1: "cpu"})
    assert list(devices_of(model).values()) == [
        "cuda:0",
        "cuda:0",
        "cuda:2",
        "cuda:2",
        "cuda:1",
        "cuda:1",
        "cpu",
        "cpu",
    ]


def test_swap_exchanges_the_devices() -> None:
    model = chain(6, devices=[0, 0, 0, 1, 1, 1])
    acts = pl.get_activation_blobs(model)
    result = pl.shift_activation_devices(model, acts, {0: 1, 1: 0})
    assert list(devices_of(model).values()) == ["cuda:1"] * 3 + ["cuda:0"] * 3
    assert result.total == 6


def test_chain_of_shifts_is_simultaneous() -> None:
    model = chain(6, devices=[0, 0, 1, 1, 2, 2])
    pl.shift_activation_devices(model, ["h1", "h3"], {0: 1, 1: 2})
    # h1's op goes 0 -> 1 and h3's op 1 -> 2; nothing moves twice
    assert list(devices_of(model).values()) == ["cuda:0", "cuda:1", "cuda:1", "cuda:2", "cuda:2", "cuda:2"]


def test_only_ops_on_source_devices_move_and_the_rest_is_logged(caplog) -> None:
    model = chain(4, devices=[0, 0, 3, 3])
    with caplog.at_level(logging.INFO, logger="placement.passes.shift"):
        result = pl.shift_activation_devices(model, ["h1", "h2", "h3"], {0: 1})
    assert list(devices_of(model).values()) == ["cuda:0", "cuda:1", "cuda:3", "cuda:3"]
    assert result.total == 1
    text = caplog.text
    assert "moved 1 ops cuda:0 -> cuda:1" in text
    assert "2 listed activations are not on a source device" in text


def test_ops_without_activation_outputs_follow_labels() -> None:
    """Data-independent ops stay; an op whose outputs are not activations follows its inputs."""
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    c = b.op("Neg", [w], "const")  # no graph input: not an activation, stays
    a = b.op("Add", [x, c], "a")
    h = b.op("Tanh", [a], "h")
    b.op("Relu", [h], "dead")  # output unconsumed: follows its input activation h
    y = b.op("Mul", [h, c], "y")
    b.output(y)
    model = b.build()
    pl.shift_activation_devices(model, ["h", "y"], {0: 1})
    assert devices_of(model) == {
        "const": "cuda:0",
        "a": "cuda:0",
        "h": "cuda:1",
        "dead": "cuda:1",
        "y": "cuda:1",
    }


def test_param_only_op_after_labelled_param_follows_it() -> None:
    """Rule 3: an op with no activations takes the label of a blob an earlier op touched."""
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w")
    a = b.op("Add", [x, w], "a")  # shifted: labels w with cuda:1
    wt = b.op("Tanh", [w], "tw")  # reads only w -> follows w's label
    y = b.op("Mul", [a, wt], "y")
    b.output(y)
    model = b.build()
    pl.shift_activation_devices(model, ["a", "y"], {0: 1})
    assert devices_of(model) == {"a": "cuda:1", "tw": "cuda:1", "y": "cuda:1"}


def test_multi_output_op_moves_if_any_listed_output() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 3))
    s0, s1 = b.op(
        "Split",
        [x],
        "split",
        outputs=["s0", "s1"],
        shapes=[(2, 3), (2, 3)],
        attributes={"axis": 0, "num_outputs": 2},
    )
    y = b.op("Add", [s0, s1], "y")
    b.output(y)
    model = b.build()
    pl.shift_activation_devices(model, ["s1"], {0: 1})
    assert devices_of(model) == {"split": "cuda:1", "y": "cuda:0"}


def test_shift_then_inject_runs_like_the_original() -> None:
    model = chain(10)
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[5:], {0: 1})
    pl.inject_cross_device_copies(model)
    check_copies(model)
    assert_same_outputs(run_ort(model, feeds), expected)


def test_shift_sees_through_existing_copies() -> None:
    """Shifting a model that has copies: copies stay put, inject repairs them."""
    model = chain(8, devices=[0] * 4 + [1] * 4)
    pl.inject_cross_device_copies(model)
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    result = pl.shift_activation_devices(model, ["h4", "h5"], {1: 0})
    assert result.total == 2
    assert all(str(op.device) == "cuda:1" for op in model.ops if op.is_copy)
    pl.inject_cross_device_copies(model)
    check_copies(model)
    assert_same_outputs(run_ort(model, feeds), expected)


def test_shifting_nothing_reports_unmodified() -> None:
    model = chain(4)
    before = snapshot(model)
    result = pl.shift_activation_devices(model, [], {0: 1})
    assert not result.modified and result.total == 0 and str(result) == "no op moved"
    assert snapshot(model) == before


# --- errors: clear, naming the offender, model unchanged ---------------------------------


def _unchanged(model: pl.Model, call) -> Exception:
    before = snapshot(model)
    with pytest.raises(pl.PlacementError) as info:
        call()
    assert snapshot(model) == before
    return info.value


@pytest.mark.parametrize(
    "name, reason",
    [
        ("w0", "parameter"),
        ("x", "graph input"),
        ("const", "depends on no graph input"),
        ("dead", "no op consumes"),
    ],
)
def test_non_activation_names_are_errors(name: str, reason: str) -> None:
    b = GraphBuilder()
    x = b.input("x")
    w = b.param("w0")
    c = b.op("Neg", [w], "const")
    a = b.op("Add", [x, c], "a")
    b.op("Relu", [a], "dead")
    b.output(b.op("Tanh", [a], "y"))
    model = b.build()
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["a", name], {0: 1}))
    assert isinstance(err, pl.NotAnActivationError)
    assert repr(name) in str(err) and reason in str(err)


def test_copy_output_is_not_an_activation() -> None:
    model = chain(4, devices=[0, 0, 1, 1])
    pl.inject_cross_device_copies(model)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h1_cuda_1"], {1: 2}))
    assert isinstance(err, pl.NotAnActivationError)
    assert "copy" in str(err) and "'h1'" in str(err)


def test_unknown_name_is_an_error() -> None:
    model = chain(4)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h2", "h9", "nope"], {0: 1}))
    assert isinstance(err, pl.UnknownBlobError) and isinstance(err, KeyError)
    assert "'h9'" in str(err) and "1 more" in str(err)


def test_unknown_source_device_is_an_error() -> None:
    model = chain(4)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h2"], {0: 1, 3: 0}))
    assert isinstance(err, pl.DeviceError)
    assert "cuda:3" in str(err) and "cuda:0" in str(err)


@pytest.mark.parametrize("shifts", [{"tpu:0": 1}, {0: "cuda:x"}, {0: -1}, {True: 1}])
def test_malformed_devices_are_errors(shifts) -> None:
    model = chain(4)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h2"], shifts))
    assert isinstance(err, pl.DeviceError)


def test_same_device_twice_and_bad_arguments() -> None:
    model = chain(4)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h2"], {0: 1, "cuda:0": 2}))
    assert isinstance(err, pl.DeviceError) and "twice" in str(err)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, ["h2"], [(0, 1)]))
    assert isinstance(err, pl.PlanError)
    err = _unchanged(model, lambda: pl.shift_activation_devices(model, [3], {0: 1}))
    assert isinstance(err, pl.UnknownBlobError)


def test_single_name_string_is_one_activation() -> None:
    model = chain(4)
    pl.shift_activation_devices(model, "h3", {0: 1})
    assert devices_of(model)["op3"] == "cuda:1"


def test_pass_object_repr_and_result_type() -> None:
    pass_ = ShiftActivationDevicesPass(["h1"], {0: 1})
    assert "1 activations" in repr(pass_) and "cuda:0: cuda:1" in repr(pass_)
    result = pass_(chain(2).ir_model)
    assert result.modified


def test_ops_computing_from_parameters_follow_their_readers(exported):
    """GPT's weight transposes move with the MatMuls that read them: nothing computed
    from parameters alone crosses a device (no per-run copy of a transposed weight)."""
    model, _, _ = exported("gpt")
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    params = set(model.parameters)
    readers: dict[str, list] = {}
    for op in model.ops:
        for blob in op.inputs:
            readers.setdefault(blob, []).append(op)
    weight_ops = [op for op in model.ops if op.inputs and all(b in params for b in op.inputs if b)]
    assert weight_ops
    moved = 0
    for op in weight_ops:
        devices = {r.device for out in op.outputs for r in readers.get(out, [])}
        if len(devices) == 1:
            assert devices == {op.device}, op.name
        moved += op.device == pl.Device("cuda", 1)
    assert moved > 0
    pl.inject_cross_device_copies(model)
    copied = {op.inputs[0] for op in model.ops if op.is_copy}
    assert not copied & {
        out for op in weight_ops for out in op.outputs if len({r.device for r in readers.get(out, [])}) == 1
    }


@pytest.mark.parametrize("order", ["given", "reversed", "twice"])
def test_names_equal_by_value_or_by_identity_shift_alike(order: str) -> None:
    # get_activation_blobs' own strings in producer order take the merge; any other form the general path
    results = []
    for fresh in (False, True):
        model = chain(8)
        acts = pl.get_activation_blobs(model)
        names = [name.encode().decode() for name in acts[2:6]] if fresh else acts[2:6]
        names = {"given": names, "reversed": names[::-1], "twice": names + names[:1]}[order]
        result = pl.shift_activation_devices(model, names, {0: 1})
        results.append((snapshot(model), result.moved))
    assert results[0] == results[1]
    assert results[0][1] == {(pl.Device("cuda", 0), pl.Device("cuda", 1)): 4}
