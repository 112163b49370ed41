"""Tests for ``placement.passes.base``: pass objects, ``PassSequence`` and debug verification."""

from __future__ import annotations

import gc

import onnx_ir as ir
import pytest
from onnx_ir.passes import PassResult, PostconditionError

import placement as pl
from placement.graph.nodes import DEVICE_KEY
from placement.passes import (
    InjectCrossDeviceCopiesPass,
    PassVerificationError,
    PlacementPass,
    ShiftActivationDevicesPass,
)
from placement.passes.base import DEBUG_ENV, check_structure, debug_enabled, no_gc
from tests.passes.helpers import chain, check_copies, snapshot


class BreakDevices(PlacementPass):
    """A buggy pass: moves one op without injecting copies, yet claims a verified model."""

    def call(self, model: ir.Model) -> PassResult:
        node = list(model.graph)[1]
        node.metadata_props[DEVICE_KEY] = "cuda:5"
        return PassResult(model, True)


class Noop(PlacementPass):
    def call(self, model: ir.Model) -> PassResult:
        return PassResult(model, False)


def sequence_for(model: pl.Model, **kwargs) -> pl.PassSequence:
    acts = pl.get_activation_blobs(model)
    return pl.PassSequence(
        ShiftActivationDevicesPass(acts[len(acts) // 2 :], {0: 1}), InjectCrossDeviceCopiesPass(), **kwargs
    )


def test_pass_sequence_reports_modified_per_step_and_is_idempotent() -> None:
    model = chain(6)
    sequence = sequence_for(model, debug=True)
    result = sequence(model)
    assert result.modified and result.model is model.ir_model
    assert [(s.name, s.modified) for s in result.steps] == [
        ("ShiftActivationDevicesPass", True),
        ("InjectCrossDeviceCopiesPass", True),
    ]
    assert all(s.seconds >= 0 for s in result.steps)
    check_copies(model)
    again = sequence(model)
    assert not again.modified and [s.modified for s in again.steps] == [False, False]


def test_debug_pass_sequence_names_the_pass_that_broke_the_model() -> None:
    model = chain(4)
    with pytest.raises(PassVerificationError, match="after pass BreakDevices") as info:
        pl.PassSequence(Noop(), BreakDevices(debug=False), debug=True)(model)
    assert isinstance(info.value, pl.VerificationError) and isinstance(info.value, PostconditionError)


def test_debug_pass_checks_itself_and_non_debug_does_not() -> None:
    with pytest.raises(PassVerificationError):
        BreakDevices(debug=True)(chain(4))
    assert BreakDevices(debug=False)(chain(4)).modified


def test_shift_is_checked_structurally_only(monkeypatch) -> None:
    """After a shift cross-device edges lack copies: debug mode must not call that an error."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert debug_enabled()
    model = chain(4)
    pl.shift_activation_devices(model, ["h3"], {0: 1})  # debug from the environment
    with pytest.raises(pl.VerificationError):
        pl.verify(model)
    pl.inject_cross_device_copies(model)
    pl.verify(model)


def test_environment_turns_debug_on(monkeypatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(PassVerificationError):
        BreakDevices()(chain(4))
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not debug_enabled()
    assert BreakDevices()(chain(4)).modified


def test_placement_errors_propagate_unchanged_through_a_pass_sequence() -> None:
    model = chain(4)
    before = snapshot(model)
    sequence = pl.PassSequence(ShiftActivationDevicesPass(["nope"], {0: 1}), InjectCrossDeviceCopiesPass())
    with pytest.raises(pl.UnknownBlobError, match="nope"):
        sequence(model)
    assert snapshot(model) == before


def test_pass_sequence_accepts_ir_models_and_onnx_ir_passes() -> None:
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    model = chain(4, devices=[0, 0, 1, 1])
    result = pl.PassSequence(RemoveUnusedNodesPass(), InjectCrossDeviceCopiesPass(), debug=True)(
        model.ir_model
    )
    assert result.modified
    check_copies(model)


def test_pass_sequence_validates_its_passes() -> None:
    with pytest.raises(ValueError):
        pl.PassSequence()
    with pytest.raises(TypeError):
        pl.PassSequence(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Noop()("not a model")
    assert "InjectCrossDeviceCopiesPass" in repr(pl.PassSequence(InjectCrossDeviceCopiesPass()))


def test_check_structure_catches_order_and_devices() -> None:
    model = chain(3)
    check_structure(model.ir_model, check_onnx=True)
    node = list(model.graph)[0]
    del node.metadata_props[DEVICE_KEY]
    with pytest.raises(pl.VerificationError, match="op0.*no device"):
        check_structure(model.ir_model)
    node.metadata_props[DEVICE_KEY] = "tpu"
    with pytest.raises(pl.VerificationError, match="op0"):
        check_structure(model.ir_model)
    node.metadata_props[DEVICE_KEY] = "cuda:0"
    model.graph.remove(node)
    model.graph.append(node)
    with pytest.raises(pl.VerificationError, match="before it is produced"):
        check_structure(model.ir_model)


def _collected(obj: object) -> bool:
    """Whether ``obj`` is in one of the collector's generations (not frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_no_gc_restores_the_collector_and_leaves_frozen_objects_frozen() -> None:
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with no_gc():
            assert not gc.isenabled()
            kept = [[i] for i in range(100)]  # allocated while paused: promoted, not swept
        assert gc.isenabled() and gc.is_tracked(kept)
        gc.freeze()  # a program that froze objects itself (say, before forking) keeps them frozen
        assert gc.get_freeze_count() > 0
        # Frozen objects sit outside the collected generations (where this Python shows it).
        shows_frozen = not _collected(kept)
        with no_gc():
            pass
        # The count itself may drop a little (frozen objects still die by reference counting:
        # temporaries frozen with the rest); gc.unfreeze() would empty it and release ``kept``.
        assert gc.get_freeze_count() > 0
        if shows_frozen:
            assert not _collected(kept)
    finally:
        gc.unfreeze()
        if not was_enabled:
            gc.disable()
