"""The expected-failure lists per environment (``_lists.py``): version conditions, the suite
release, and regeneration in another environment (``--where``), on small lists in a temp dir."""

from __future__ import annotations

import pytest
from packaging.version import Version

from tests.conformance import _cases, _lists

HEADER = "# Expected failures of the demo runtime.\n# suite: onnx 1.23.2\n"


@pytest.fixture
def demo(tmp_path, monkeypatch):
    """A ``demo`` runtime's list in a temp dir, under an installed onnx 1.17.0 and torch 2.11.0."""
    monkeypatch.setattr(_lists, "HERE", tmp_path)
    versions = {"onnx": Version("1.17.0"), "torch": Version("2.11.0"), "onnxruntime": Version("1.31.1")}
    monkeypatch.setattr(_lists, "installed", versions.__getitem__)

    def write(body: str) -> None:
        (tmp_path / "xfail_demo.txt").write_text(HEADER + body)

    return write


def test_a_condition_holds_where_every_requirement_does(demo):
    assert _lists.holds(None)
    assert _lists.holds("onnx<1.18") and not _lists.holds("onnx>=1.18")
    assert _lists.holds("onnx<1.18; torch==2.11.*") and not _lists.holds("onnx<1.18; torch>=2.15")


def test_a_malformed_condition_names_itself(demo):
    demo("test_abs [onnx]: reason\n")
    with pytest.raises(ValueError, match="'onnx'"):
        _lists.entries("demo")


def test_entries_apply_where_their_condition_holds(demo):
    demo(
        "test_abs: everywhere\n"
        "test_add [onnx>=1.18]: newer cases only\n"
        "test_sub [onnx<1.18]: onnx 1.17's case: its values\n"
    )
    assert _lists.entries("demo")["test_sub"] == _lists.Entry("onnx 1.17's case: its values", "onnx<1.18")
    assert _lists.applicable("demo") == {"test_abs": "everywhere", "test_sub": "onnx 1.17's case: its values"}


def test_cases_an_older_onnx_lacks_are_ignored_but_stale_entries_fail_under_the_suite_release(
    demo, monkeypatch
):
    demo("test_abs: reason\ntest_gone: reason\n")
    assert _lists.suite_release("demo") == Version("1.23.2")
    assert _lists.stale("demo", {"test_abs"}) == []  # onnx 1.17 does not generate test_gone
    newer = {"onnx": Version("1.23.2")}
    monkeypatch.setattr(_lists, "installed", newer.__getitem__)
    assert _lists.stale("demo", {"test_abs"}) == ["test_gone"]


def test_complement_inverts_one_requirement():
    assert _lists.complement("onnx<1.18") == "onnx>=1.18"
    assert _lists.complement("torch>=2.15") == "torch<2.15"
    with pytest.raises(ValueError, match="complement"):
        _lists.complement("torch~=2.15")


def test_regenerating_elsewhere_writes_the_differences_as_conditions(demo, monkeypatch, capsys):
    demo(
        "test_a: fails everywhere\n"
        "test_b: passes under onnx 1.17\n"
        "test_c [onnx<1.18]: was 1.17 only, passes now\n"
        "test_d [onnx>=1.18]: fails under 1.17 too\n"
        "test_newer: a case onnx 1.17 lacks\n"
    )
    present = dict.fromkeys(["test_a", "test_b", "test_c", "test_d", "test_e"])
    monkeypatch.setattr(_cases, "cases", lambda: present)
    now = {"test_a": "x", "test_d": "y", "test_e": "new failure"}
    keep = _cases._regenerate("demo", now, grow=True, where="onnx<1.18")
    assert keep == {
        "test_a": _lists.Entry("fails everywhere"),
        "test_b": _lists.Entry("passes under onnx 1.17", "onnx>=1.18"),
        "test_d": _lists.Entry("fails under 1.17 too"),
        "test_e": _lists.Entry("new failure", "onnx<1.18"),
        "test_newer": _lists.Entry("a case onnx 1.17 lacks"),
    }
    _lists.write("demo", keep, "suite: onnx 1.23.2")
    assert _lists.entries("demo") == keep and _lists.suite_release("demo") == Version("1.23.2")


def test_regenerating_without_where_drops_what_passes_and_keeps_other_environments(demo, monkeypatch):
    demo("test_a: passes now\ntest_b [onnx>=1.18]: another environment's\ntest_c: fails\n")
    monkeypatch.setattr(_cases, "cases", lambda: dict.fromkeys(["test_a", "test_b", "test_c"]))
    keep = _cases._regenerate("demo", {"test_c": "x"}, grow=False, where=None)
    assert keep == {
        "test_b": _lists.Entry("another environment's", "onnx>=1.18"),
        "test_c": _lists.Entry("fails"),
    }
