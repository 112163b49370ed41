"""Tests for ``placement.runtime.ort.runner``: equality with torch and one ORT session on every zoo model,
device maps, inputs, transfers, and re-placement that rebuilds only changed stages."""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement as pl
from placement.graph.saving import to_proto
from placement.runtime import device_map as device_map_module
from placement.runtime.device_map import PhysicalDevice
from placement.runtime.ort import build
from placement.runtime.ort.sessions import ort_log_severity
from placement.runtime.ort.steps import StageStep, TransferStep
from placement.runtime.ort.values import transfer_kind
from tests.conftest import MODEL_NAMES
from tests.passes.helpers import GraphBuilder, churn

RTOL = ATOL = 1e-4


# --- placements -------------------------------------------------------------------------


def place_shift(model: pl.Model, n_devices: int) -> pl.Model:
    """Split the activations into ``n_devices`` equal runs on cuda:0..n-1 (Caffe2 style)."""
    acts = pl.get_activation_blobs(model)
    for k in range(1, n_devices):
        pl.shift_activation_devices(model, acts[k * len(acts) // n_devices :], {k - 1: k})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    return model


def place_random(model: pl.Model, n_devices: int, seed: int) -> pl.Model:
    """Every op on a random device (seeded), then copies."""
    rng = np.random.default_rng(seed)
    for op in model.ops:
        model.set_device(op.name, int(rng.integers(n_devices)))
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    return model


@functools.cache
def _references(name: str):
    """(torch outputs, single-ORT-session outputs) of the unplaced tiny model."""
    from tests.conftest import export_once

    model, net, args = export_once(name)
    with torch.no_grad():
        out = net(*args)
    expected = [t.numpy() for t in (out if isinstance(out, (tuple, list)) else (out,))]
    session = ort.InferenceSession(to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    single = session.run(None, {n: a.numpy() for n, a in zip(model.inputs, args)})
    return expected, single


def _check(name: str, outputs: list[np.ndarray]) -> None:
    expected, single = _references(name)
    churn()  # outputs that alias released memory get overwritten before the comparison
    assert len(outputs) == len(expected)
    for got, want, one in zip(outputs, expected, single):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got, one, rtol=RTOL, atol=ATOL)


# --- equality on the zoo ----------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("n_devices", [2, 4])
def test_shift_placement_matches_torch_and_single_session(exported, name, n_devices):
    model, _, args = exported(name)
    place_shift(model, n_devices)
    assert len(model.devices) == n_devices
    _check(name, pl.run(model, args))


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("n_devices,seed", [(2, 0), (4, 1)])
def test_random_placement_matches(exported, name, n_devices, seed):
    model, _, args = exported(name)
    place_random(model, n_devices, seed)
    _check(name, pl.run(model, {n: a for n, a in zip(model.inputs, args)}))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_two_logical_devices_on_one_physical_device(exported, name):
    model, _, args = exported(name)
    place_shift(model, 4)
    runner = pl.Runner(model, device_map={0: "cpu", 1: "cpu", 2: "cpu", 3: "cpu"})
    assert {str(p) for p in runner.device_map.values()} == {"cpu"}
    _check(name, runner.run(args))


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_device_map_cpu_and_unplaced_model(exported, name):
    model, _, args = exported(name)
    _check(name, pl.run(model, args, device_map="cpu"))  # one device, one stage
    place_shift(model, 2)
    _check(name, pl.run(model, args, device_map="cpu"))


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_placement_without_copies_runs_as_if_injected(exported, name):
    model, _, args = exported(name)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[len(acts) // 2 :], {0: 1})
    state, n_ops = model.device_state(), len(model.ops)
    with pytest.raises(pl.VerificationError):
        pl.verify(model)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    _check(name, runner.run(args))
    moves = [step for step in runner.program.steps if isinstance(step, TransferStep)]
    assert moves and all(step.kind == "alias" for step in moves)  # emulated devices share values
    assert runner.stats.transfers == 0
    assert model.device_state() == state and len(model.ops) == n_ops  # user's model untouched


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n_devices=st.integers(2, 4), inject=st.booleans())
def test_random_placements_of_the_mlp(seed, n_devices, inject):
    from tests.conftest import export_once

    base, _, args = export_once("mlp")
    model = base.copy()
    rng = np.random.default_rng(seed)
    for op in model.ops:
        model.set_device(op.name, int(rng.integers(n_devices)))
    if inject:
        pl.inject_cross_device_copies(model)
    _check("mlp", pl.run(model, args))


# --- outputs own their memory ----------------------------------------------------------


def test_output_copied_to_the_output_device_survives_later_allocations():
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"], name="relu"),
            helper.make_node("Neg", ["a"], ["b"], name="neg"),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3]),
        ],
    )
    model = pl.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    model.set_device("neg", 1)
    pl.inject_cross_device_copies(model)
    x = np.random.default_rng(0).random(3).astype(np.float32)
    for device_map in ("cpu", "auto"):
        a, b = pl.run(model, [x], device_map=device_map)
        junk = [np.full(3, 7.0, np.float32) for _ in range(100)]
        np.testing.assert_array_equal(a, np.maximum(x, 0))
        np.testing.assert_array_equal(b, -np.maximum(x, 0))
        del junk


def test_outputs_on_several_devices_outlive_the_runner():
    """Each graph output is produced on a different device (one is a graph input's
    copy, one a session output, one moved by a copy); all stay valid after the
    runner and its values are gone and memory is reused."""
    b = GraphBuilder()
    x = b.input("x")
    h0 = b.op("Tanh", [x], "t0", device=0)
    h1 = b.op("Relu", [h0], "r1", device=1)
    h2 = b.op("Add", [h1, h0], "add2", device=2)
    h3 = b.op("Neg", [h2], "neg3", device="cpu")
    b.output(h0, h1, h2, h3, x)
    model = b.build()
    pl.inject_cross_device_copies(model)
    feed = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    outputs = [runner.run({"x": feed}) for _ in range(3)]
    del runner
    churn()
    t = np.tanh(feed)
    want = [t, np.maximum(t, 0), np.maximum(t, 0) + t, -(np.maximum(t, 0) + t), feed]
    for got in outputs:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- runner behaviour -------------------------------------------------------------------


def test_runner_reuses_sessions_and_outputs_are_not_overwritten(exported):
    model, net, (x,) = exported("mlp")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map="cpu", fold=False)
    first = runner.run([x])[0]
    kept = first.copy()
    x2 = torch.randn_like(x)
    second = runner.run([x2])[0]
    np.testing.assert_array_equal(first, kept)  # the next run did not reuse its buffer
    with torch.no_grad():
        np.testing.assert_allclose(second, net(x2).numpy(), rtol=RTOL, atol=ATOL)
    assert runner.stats.sessions_built == 2 and runner.stats.partitions == 1
    assert runner.stats.runs == 2


def test_stages_on_their_logical_devices(exported, monkeypatch):
    monkeypatch.setattr(device_map_module, "cuda_device_count", lambda runtime="torch": 0)  # emulated
    model, _, _ = exported("gpt")
    place_shift(model, 2)
    runner = pl.Runner(model)
    assert [str(s.device) for s in runner.stages] == ["cuda:0", "cuda:1"]
    assert all(p.emulated for p in runner.device_map.values())
    sessions = [step.exec.session for step in runner.program.steps if isinstance(step, StageStep)]
    assert len({id(s) for s in sessions}) == 2  # one session per stage
    assert all(s.get_providers() == ["CPUExecutionProvider"] for s in sessions)


def test_emulation_is_announced_once(exported, monkeypatch):
    # The module's own logger is replaced (not read through caplog), so the test does not
    # depend on how earlier tests in this worker left logging configured.
    warned: list[str] = []
    real = device_map_module.log

    class Log:
        def warning(self, msg: str, *args: object) -> None:
            warned.append(msg % args)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    monkeypatch.setattr(device_map_module, "log", Log())
    monkeypatch.setattr(device_map_module, "_warned_emulation", False)
    monkeypatch.setattr(device_map_module, "cuda_device_count", lambda runtime="torch": 0)
    model, _, args = exported("mlp")
    place_shift(model, 2)
    pl.run(model, args)
    pl.run(model, args)
    messages = [m for m in warned if "EMULATING" in m]
    assert len(messages) == 1 and "cuda:0, cuda:1" in messages[0], warned


def test_missing_gpu_in_an_explicit_map_is_an_error(exported):
    model, _, _ = exported("mlp")
    place_shift(model, 2)
    with pytest.raises(pl.DeviceError, match="cuda:7"):
        pl.Runner(model, device_map={0: "cpu", 1: "cuda:7"})


# --- re-placement (update_flow) ---------------------------------------------------------


def test_replacement_rebuilds_only_changed_stages(exported):
    model, net, args = exported("gpt")
    place_shift(model, 3)  # stages on cuda:0, cuda:1, cuda:2
    runner = pl.Runner(model, device_map="cpu", fold=False)
    assert [str(s.device) for s in runner.stages] == ["cuda:0", "cuda:1", "cuda:2"]
    before = {s.index: s.fingerprint for s in runner.stages}
    _check("gpt", runner.run(args))
    assert runner.update() is False  # nothing changed

    # move the last segment to a new device (modelsplit: layer_gpus[...] = 3; update_flow())
    for op in model.ops:
        if op.device == pl.Device("cuda", 2):
            model.set_device(op.name, 3)
    pl.inject_cross_device_copies(model)
    _check("gpt", runner.run(args))  # run notices the change by itself
    after = {s.index: s.fingerprint for s in runner.stages}
    assert [str(s.device) for s in runner.stages] == ["cuda:0", "cuda:1", "cuda:3"]
    assert after[0] == before[0] and after[1] == before[1] and after[2] != before[2]
    assert runner.stats.partitions == 2
    assert runner.stats.sessions_built == 3 + 1  # only the moved stage was rebuilt
    assert runner.stats.sessions_reused == 2


def test_replacement_with_stale_copies_and_explicit_update(exported):
    model, net, args = exported("mlp")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map="cpu", fold=False, auto_update=False)
    last = [op for op in model.ops if not op.is_copy][-1]
    model.set_device(last.name, 2)  # copies are now stale: no copy into cuda:2
    (out,) = runner.run(args)  # no auto update: still the old placement, still right
    with torch.no_grad():
        np.testing.assert_allclose(out, net(*args).numpy(), rtol=1e-5, atol=1e-5)
    assert runner.stats.partitions == 1
    assert runner.update() is True
    assert {str(s.device) for s in runner.stages} == {"cuda:0", "cuda:1", "cuda:2"}
    _check("mlp", runner.run(args))
    assert runner.stats.sessions_built == 2 + 2  # cuda:1's stage lost an op; cuda:2's is new
    assert runner.update(force=True) is True
    assert runner.stats.sessions_built == 4  # a forced re-partition reuses every session
    assert runner.stats.sessions_reused == 1 + 3


def test_keep_sessions_makes_switching_back_free(exported):
    model, _, args = exported("mlp")
    place_shift(model, 2)
    state = model.device_state()
    runner = pl.Runner(model, device_map="cpu", keep_sessions=True)
    last = [op for op in model.ops if not op.is_copy][-1]
    model.set_device(last.name, 2)
    runner.run(args)
    built = runner.stats.sessions_built
    model.restore_device_state(state)  # back to the first placement
    _check("mlp", runner.run(args))
    assert runner.stats.sessions_built == built  # every stage session was kept


# --- inputs -----------------------------------------------------------------------------


@pytest.fixture
def gpt_runner(exported):
    model, _, args = exported("gpt")
    place_shift(model, 2)
    return pl.Runner(model, device_map="cpu"), model, args


def test_inputs_as_dict_sequence_array_and_torch(gpt_runner):
    runner, model, (idx,) = gpt_runner
    name = model.inputs[0]
    ref = runner.run({name: idx.numpy()})[0]
    for inputs in ([idx], (idx.numpy(),), idx, idx.numpy(), {name: idx}):
        np.testing.assert_allclose(runner.run(inputs)[0], ref, rtol=1e-6, atol=1e-6)  # a GPU may reorder sums


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda n, a: {"nope": a}, r"unknown input 'nope'.*'idx'"),
        (lambda n, a: {}, r"missing input 'idx'"),
        (lambda n, a: [a, a], r"got 2 inputs but the model has 1"),
        (lambda n, a: {n: a.astype(np.uint64)}, r"input 'idx' has dtype uint64, expected int64"),  # lossy
        (lambda n, a: {n: a[:, :3]}, r"input 'idx' has size 3 in dimension 1, expected 8"),
        (lambda n, a: {n: a[0]}, r"input 'idx' has rank 1, expected 2"),
        (lambda n, a: {n: "text"}, r"input 'idx': expected a numpy array"),
        (lambda n, a: 42, r"dict by name or a sequence"),
    ],
)
def test_bad_inputs_name_the_input(gpt_runner, make, match):
    runner, model, (idx,) = gpt_runner
    with pytest.raises(pl.InputError, match=match):
        runner.run(make(model.inputs[0], idx.numpy()))


# --- transfers --------------------------------------------------------------------------


def test_transfer_kinds():
    cpu_a = PhysicalDevice("cpu", 0, emulated=True)
    gpu0, gpu0b, gpu1 = PhysicalDevice("cuda", 0), PhysicalDevice("cuda", 0), PhysicalDevice("cuda", 1)
    kind = transfer_kind
    assert kind(cpu_a, cpu_a, same_logical=True) == "alias"
    assert kind(cpu_a, cpu_a, same_logical=False) == "alias"  # emulated devices share host memory
    assert kind(gpu0, gpu0b, same_logical=False) == "alias"  # two logical GPUs on one GPU
    assert kind(gpu0, gpu1, same_logical=False) == "d2d"
    assert kind(gpu0, cpu_a, same_logical=False) == "d2h"
    assert kind(cpu_a, gpu1, same_logical=False) == "h2d"
    assert kind(PhysicalDevice("cpu"), PhysicalDevice("cpu"), same_logical=False) == "alias"


def test_intermediate_values_are_freed_after_last_use(exported):
    model, _, _ = exported("unet")
    place_shift(model, 4)
    runner = pl.Runner(model, device_map="cpu")
    program = runner.program
    freed = {key for step in program.steps for key in step.free}
    kept = {key for key, _ in program.outputs}
    produced = set(program.partition.inputs)
    for step in program.steps:
        produced |= {step.target} if isinstance(step, TransferStep) else set(step.outputs)
    assert produced - kept == freed


def test_runtime_benchmark_smoke():
    from benchmarks.runtime import measure_ort

    row = measure_ort("mlp", "tiny", devices=2, repeats=2, warmup=1, explain=True, block=2)
    assert row["stages"] == 2 and row["max_abs_diff"] < 1e-4
    assert row["single_ms"] > 0 and row["placed_ms"] > 0 and row["ratio"] > 0
    causes = {"cut", "transfers", "binding", "checks", "outputs", "other"}
    assert causes <= set(row["explain"])
    assert row["explain"]["total"] == pytest.approx(sum(row["explain"][c] for c in causes), abs=1e-3)


def test_cpu_stages_run_without_bindings_and_hand_out_fresh_outputs(exported):
    """A stage on the CPU calls its session once per run (no IOBinding); each run's
    outputs are new buffers, so earlier results stay as they were."""
    model, _, (x,) = exported("mlp")
    place_shift(model, 2)
    runner = pl.Runner(model, device_map="cpu")
    stages = [step for step in runner.program.steps if isinstance(step, StageStep)]
    assert stages and all(s.exec.direct is not None and s.exec.binding is None for s in stages)
    values = runner.program.feed([x.numpy()])
    first = stages[0].call(stages[0].inputs(values))
    second = stages[0].call(stages[0].inputs(values))
    assert all(isinstance(v, ort.OrtValue) for v in first)
    assert first[0].data_ptr() != second[0].data_ptr()
    np.testing.assert_array_equal(first[0].numpy(), second[0].numpy())


# --- values that are not numeric tensors -------------------------------------------------


def test_sequences_optionals_and_strings_cross_devices_as_ort_takes_them():
    """A sequence built on device 0 is read on device 1; a string tensor and an optional
    go in and out; placed outputs equal one plain session's."""
    from onnx import TensorProto, helper

    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "x"], ["seq"], name="construct"),
        helper.make_node("SequenceInsert", ["seq", "x"], ["seq3"], name="insert"),
        helper.make_node("ConcatFromSequence", ["seq3"], ["cat"], name="concat", axis=0),
        helper.make_node("StringConcat", ["s", "s"], ["ss"], name="strcat"),
        helper.make_node("OptionalHasElement", ["opt"], ["has"], name="has"),
        helper.make_node("Identity", ["opt"], ["opt_out"], name="opt_id"),
    ]
    graph = helper.make_graph(
        nodes,
        "non_tensors",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("s", TensorProto.STRING, [2]),
            helper.make_value_info("opt", opt_type),
        ],
        [
            helper.make_value_info("seq3", seq_type),
            helper.make_tensor_value_info("cat", TensorProto.FLOAT, [6]),
            helper.make_tensor_value_info("ss", TensorProto.STRING, [2]),
            helper.make_tensor_value_info("has", TensorProto.BOOL, []),
            helper.make_value_info("opt_out", opt_type),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    plain = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for how in ("every other op", "last op"):
        model = pl.load(proto)
        moved = model.ops[1::2] if how == "every other op" else model.ops[-1:]
        for op in moved:
            model.set_device(op.name, 1)
        pl.inject_cross_device_copies(model)
        for opt in (np.array([5.0, 6.0], np.float32), None):
            feeds = {
                "x": np.array([1.0, 2.0], np.float32),
                "s": np.array(["a", "b"], dtype=object),
                "opt": opt,
            }
            got = pl.run(model, feeds)
            churn()
            want = plain.run(None, feeds)
            assert isinstance(got[0], list) and len(got[0]) == 3
            for g, w in zip(got[0], want[0]):
                np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(got[1], want[1])
            assert got[2].tolist() == ["aa", "bb"] == want[2].tolist()
            assert bool(got[3]) == (opt is not None)
            if opt is None:
                assert got[4] is None and want[4] is None
            else:
                np.testing.assert_array_equal(got[4], opt)


# --- quiet runs --------------------------------------------------------------------------


def _ir3_model():
    """An IR version 3 model: every initializer is also listed as a graph input."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), f"w{i}") for i in range(4)
    ]
    nodes, h = [], "x"
    for i in range(4):
        nodes.append(helper.make_node("MatMul", [h, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"t{i}"], name=f"tanh{i}"))
        h = f"t{i}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, [3, 3]) for w in weights]
    graph = helper.make_graph(
        nodes,
        "ir3",
        inputs,
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, [2, 3])],
        initializer=weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3), weights


def test_ir3_initializers_are_parameters_not_inputs_unless_asked():
    from onnx import numpy_helper

    proto, weights = _ir3_model()
    model = pl.load(proto)
    assert model.inputs == ["x"] and [v.name for v in model.graph.inputs] == ["x"]
    assert set(model.parameters) == {w.name for w in weights}
    assert [i.name for i in to_proto(model).graph.input] == ["x"]
    kept = pl.load(proto, initializers_as_inputs=True)
    assert [v.name for v in kept.graph.inputs] == ["x", "w0", "w1", "w2", "w3"]
    x = np.ones((2, 3), np.float32)
    want = x
    for w in weights:
        want = np.tanh(want @ numpy_helper.to_array(w))
    model.set_device("mm2", 1)
    pl.inject_cross_device_copies(model)
    np.testing.assert_allclose(pl.run(model, {"x": x})[0], want, rtol=1e-5)


def test_runs_stay_quiet_at_the_default_log_level(capfd, caplog):
    """Placing and running an IR-3 model prints nothing from ONNX Runtime by default; with
    the placement logger at DEBUG, ONNX Runtime's own messages come through."""
    proto, _ = _ir3_model()
    x = np.ones((2, 3), np.float32)

    def place_and_run() -> str:
        model = pl.load(proto, initializers_as_inputs=True)  # the IR-3 form ORT would warn about
        for name in ("tanh1", "mm2", "tanh3"):
            model.set_device(name, 1)
        pl.inject_cross_device_copies(model)
        capfd.readouterr()
        pl.Runner(model, device_map="cpu").run({"x": x})
        return capfd.readouterr().err

    assert ort_log_severity() == 4
    assert "onnxruntime" not in place_and_run()
    with caplog.at_level(logging.DEBUG, logger="placement"):
        assert ort_log_severity() == 1
        assert "onnxruntime" in place_and_run()


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_stale_copies_run_as_if_reinjected(exported, name):
    model, _, args = exported(name)
    place_shift(model, 2)
    for op in model.ops:  # undo the shift behind the copies' back, then move a prefix to cuda:2
        if not op.is_copy and op.device == pl.Device("cuda", 1):
            model.set_device(op.name, 0)
    compute = [op for op in model.ops if not op.is_copy]
    for op in compute[: len(compute) // 3]:
        model.set_device(op.name, 2)
    before = [(op.name, op.inputs, op.outputs, str(op.device)) for op in model.ops]
    _check(name, pl.run(model, args, device_map="cpu"))
    assert [(op.name, op.inputs, op.outputs, str(op.device)) for op in model.ops] == before


def test_replacement_during_a_rebuild_is_retried(exported, monkeypatch):
    model, _, args = exported("mlp")
    compute = [op.name for op in model.ops]
    runner = pl.Runner(model, device_map="cpu", fold=False)
    real_plan = build.split_stages
    calls = []

    def plan_then_replace(m):  # another thread re-places the model right after it was partitioned
        part = real_plan(m)
        calls.append(len(part.stages))
        if len(calls) == 1:
            for name in compute:
                model.set_device(name, 0)
        return part

    for name in compute[len(compute) // 2 :]:
        model.set_device(name, 1)
    monkeypatch.setattr(build, "split_stages", plan_then_replace)
    _check("mlp", runner.run(args))  # runs the placement it partitioned, whole
    assert calls == [2] and [str(s.device) for s in runner.stages] == ["cuda:0", "cuda:1"]
    _check("mlp", runner.run(args))  # and follows the change at the next run
    assert calls == [2, 1] and [str(s.device) for s in runner.stages] == ["cuda:0"]


def test_runs_from_threads_while_another_thread_replaces(exported):
    import threading

    model, _, args = exported("mlp")
    compute = [op.name for op in model.ops]
    runner = pl.Runner(model, device_map="cpu")
    stop, errors = threading.Event(), []

    def replace():
        k = 0
        while not stop.is_set():
            k += 1
            for i, name in enumerate(compute):
                model.set_device(name, 0 if i < len(compute) // 2 else k % 3)

    def work():
        try:
            for _ in range(20):
                _check("mlp", runner.run(args))
        except Exception as err:  # noqa: BLE001 (collected and reported below)
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(3)]
    mover = threading.Thread(target=replace)
    mover.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    mover.join()
    assert not errors, errors[:3]
    assert runner.stats.runs == 60


def test_onnx_runtime_failures_in_a_run_name_the_stage_and_op(exported):
    model, _, args = exported("gpt")
    place_shift(model, 2)
    tokens = args[0].numpy().copy()
    tokens[0, 0] = 10**6  # no such token id
    with pytest.raises(pl.PlacementError, match=r"stage 0 .*failed in ONNX Runtime.*Gather") as err:
        pl.run(model, [tokens], device_map="cpu")
    assert not isinstance(err.value, (KeyError, IndexError))
