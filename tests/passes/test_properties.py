"""Property tests: random DAGs with random devices through shift and copy injection.

After injection every cross-device edge goes through exactly one copy per (blob,
device), no copy is redundant or unused, ``verify`` passes, a second injection
changes nothing, and both one plain ONNX Runtime session and the placed runtime
(``pl.run``: a session per stage, copies between emulated devices) give the
unplaced outputs. Random DAGs have several graph outputs on random devices, and
placed outputs are compared only after other memory was allocated and freed
(:func:`tests.passes.helpers.run_placed`), so an output that aliases a released
buffer fails.
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement as pl
from tests.passes.helpers import (
    DEVICES,
    assert_same_outputs,
    check_copies,
    dags,
    feeds_for,
    random_dag,
    run_ort,
    run_placed,
    snapshot,
)

#: ``PLACEMENT_PROPERTY_EXAMPLES=2000`` runs a deeper search locally.
EXAMPLES = int(os.environ.get("PLACEMENT_PROPERTY_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
io_devices = st.sampled_from([None, *DEVICES])


def inject_and_check(model: pl.Model, expected, feeds, **kwargs) -> None:
    pl.inject_cross_device_copies(model, **kwargs)
    check_copies(model)
    before = snapshot(model)
    assert not pl.inject_cross_device_copies(model, **kwargs).modified
    assert snapshot(model) == before
    assert_same_outputs(run_ort(model, feeds), expected)
    assert_same_outputs(run_placed(model, feeds), expected)
    for name in model.inputs:
        assert name in feeds  # graph inputs keep their names
    if kwargs.get("output_device") is not None:
        assert str(model.output_device) == str(pl.Device.parse(kwargs["output_device"]))


@SETTINGS
@given(model=dags(), input_device=io_devices, output_device=io_devices)
def test_injection_on_random_dags(model: pl.Model, input_device, output_device) -> None:
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    assert_same_outputs(run_placed(model, feeds), expected)  # implicit transfers, no copies yet
    outputs = model.outputs
    inject_and_check(model, expected, feeds, input_device=input_device, output_device=output_device)
    assert model.outputs == outputs


@SETTINGS
@given(model=dags(), seed=st.integers(0, 2**32 - 1), output_device=io_devices)
def test_repair_after_random_replacement(model: pl.Model, seed: int, output_device) -> None:
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    pl.inject_cross_device_copies(model, output_device=output_device)
    rng = random.Random(seed)
    for op in model.ops:
        if not op.is_copy and rng.random() < 0.5:
            model.set_device(op.name, rng.choice(DEVICES))
    inject_and_check(model, expected, feeds, output_device=output_device)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_shifts_then_injection(seed: int, data) -> None:
    model = random_dag(random.Random(seed), num_devices=2)
    feeds = feeds_for(model)
    expected = run_ort(model, feeds)
    if data.draw(st.booleans(), label="inject first"):
        pl.inject_cross_device_copies(model)
    acts = pl.get_activation_blobs(model)
    chosen = data.draw(st.lists(st.sampled_from(acts), unique=True) if acts else st.just([]), label="acts")
    used = sorted(model.devices)
    sources = data.draw(st.lists(st.sampled_from(used), min_size=1, unique=True), label="sources")
    targets = data.draw(
        st.lists(st.sampled_from(DEVICES), min_size=len(sources), max_size=len(sources)), label="targets"
    )
    shifts = {source: pl.Device.parse(target) for source, target in zip(sources, targets)}
    before = {op.name: op.device for op in model.ops}
    result = pl.shift_activation_devices(model, chosen, shifts)
    for source, target in result.moved:  # ops move from a source to its target only
        assert shifts[source] == target != source
    for op in model.ops:
        if op.is_copy or op.device == before[op.name]:
            continue
        assert shifts[before[op.name]] == op.device
    listed = set(chosen)
    for op in model.ops:  # an op producing a listed activation on a source device moved
        if not op.is_copy and before[op.name] in shifts and listed & set(op.outputs):
            assert op.device == shifts[before[op.name]]
    inject_and_check(model, expected, feeds)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_swap_exchanges_every_activation_producer(seed: int) -> None:
    model = random_dag(random.Random(seed), num_devices=2)
    if len(model.devices) < 2:
        return
    acts = set(pl.get_activation_blobs(model))
    other = {pl.Device("cuda", 0): pl.Device("cuda", 1), pl.Device("cuda", 1): pl.Device("cuda", 0)}
    before = {op.name: op.device for op in model.ops}
    pl.shift_activation_devices(model, sorted(acts), {0: 1, 1: 0})
    for op in model.ops:
        if acts & set(op.outputs):
            assert op.device == other[before[op.name]]
        else:  # ops without activations (constants, dead ends) stay or follow a label
            assert op.device in (before[op.name], other[before[op.name]])


def reference_shift(model: pl.Model, names: list[str], shifts: dict) -> dict[str, pl.Device]:
    """The shift rules of ARCHITECTURE.md, written plainly over op views (the oracle)."""
    shifts = {pl.Device.parse(k): pl.Device.parse(v) for k, v in shifts.items()}
    acts, listed = set(pl.get_activation_blobs(model)), set(names)
    origin: dict[str, str] = {}
    labels: dict[str, pl.Device] = {}
    placed = {}
    for op in model.ops:
        if op.is_copy:
            origin[op.outputs[0]] = origin.get(op.inputs[0], op.inputs[0])
            continue
        device = op.device
        placed[op.name] = device
        if device not in shifts:
            continue
        target = shifts[device]
        inputs = [origin.get(b, b) for b in op.inputs if b]
        outs = [b for b in op.outputs if b in acts]
        if any(b in listed for b in outs):
            new = target
        elif outs:
            new = device
        else:
            allowed = (device, target)
            new = next((labels[b] for b in inputs if b in acts and labels.get(b) in allowed), None)
            if new is None:
                new = next((labels[b] for b in inputs if labels.get(b) in allowed), device)
        for b in inputs:
            if b not in acts:
                labels.setdefault(b, new)
        for b in op.outputs:
            if b in acts:
                labels[b] = target if b in listed else device
            else:
                labels.setdefault(b, new)
        placed[op.name] = new
    # ops computing from parameters alone follow their readers to the target
    params = set(model.parameters)
    independent: set[str] = set()
    for op in model.ops:
        if all(not b or b in params or b in independent for b in op.inputs):
            independent.update(op.outputs)
    outputs = set(model.outputs)
    for op in reversed(model.ops):
        device = op.device
        if op.is_copy or device not in shifts or shifts[device] == device or not op.outputs:
            continue
        if not all(b in independent for b in op.outputs) or placed[op.name] == shifts[device]:
            continue
        ends = {device for b in op.outputs if b in outputs}
        for reader in model.ops:
            if set(reader.inputs) & set(op.outputs):
                ends.add(reader.device if reader.is_copy else placed[reader.name])
        if ends == {shifts[device]}:
            placed[op.name] = shifts[device]
    return placed


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_shift_matches_the_reference_rules(seed: int, data) -> None:
    model = random_dag(random.Random(seed), num_devices=3, dead_ends=True)
    if data.draw(st.booleans(), label="inject first"):
        pl.inject_cross_device_copies(model)
    acts = pl.get_activation_blobs(model)
    chosen = data.draw(st.lists(st.sampled_from(acts), unique=True) if acts else st.just([]), label="acts")
    sources = data.draw(st.lists(st.sampled_from(sorted(model.devices)), min_size=1, unique=True))
    targets = data.draw(st.lists(st.sampled_from(DEVICES), min_size=len(sources), max_size=len(sources)))
    shifts = dict(zip(sources, targets))
    expected = reference_shift(model, chosen, shifts)
    pl.shift_activation_devices(model, chosen, shifts)
    assert {op.name: op.device for op in model.ops if not op.is_copy} == expected
