"""CI's environments (constraints.txt and .ci/envs/*.txt) against what pyproject.toml declares: every
pin is admitted, and every declared lower bound of a version-sensitive dependency is one CI tests."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENVS = sorted((ROOT / ".ci" / "envs").glob("*.txt"))
# the dependencies whose APIs the package and its tests use version by version
SENSITIVE = ["torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime-gpu"]
LINUX = {"platform_system": "Linux", "platform_machine": "x86_64"}


def _declared() -> dict[str, SpecifierSet]:
    """Each requirement (dependencies and every extra) that applies on Linux x86-64, by name."""
    project = PYPROJECT["project"]
    found: dict[str, SpecifierSet] = {}
    extras = [line for group in project["optional-dependencies"].values() for line in group]
    for line in [*project["dependencies"], *extras]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(LINUX):
            found[canonicalize_name(req.name)] = req.specifier
    return found


def _pins(path: Path) -> tuple[str | None, dict[str, Version]]:
    """(the ``# python: X.Y`` line's version, ``name==version`` pins by name) of a constraints file."""
    text = path.read_text()
    python = re.search(r"^# python: *([0-9.]+)", text, re.M)
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return (python.group(1) if python else None), pins


def _extras(path: Path) -> list[str]:
    """The extras a CI env file's ``# extras: a, b`` line names (scripts/test-env.sh installs them)."""
    found = re.search(r"^# extras: *(.+)$", path.read_text(), re.M)
    return [name.strip() for name in found.group(1).split(",")] if found else []


def _lower(spec: SpecifierSet) -> Version | None:
    bounds = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    return max(bounds) if bounds else None


def test_there_are_the_envs_ci_runs():
    assert {p.stem for p in ENVS} >= {"gpu-image", "newest"}


@pytest.mark.parametrize("path", [ROOT / "constraints.txt", *ENVS], ids=lambda p: p.name)
def test_every_pin_is_admitted_by_pyproject(path):
    declared = _declared()
    python, pins = _pins(path)
    if path.parent.name == "envs":
        assert python, f"{path.name} names no Python ('# python: X.Y')"
        assert Version(python) in SpecifierSet(PYPROJECT["project"]["requires-python"]), path.name
        assert set(SENSITIVE) <= set(pins), f"{path.name} leaves {set(SENSITIVE) - set(pins)} to chance"
    for name, version in pins.items():
        if name in declared:
            assert version in declared[name], f"{path.name}: {name} {version} is outside {declared[name]}"


def test_declared_lower_bounds_are_versions_ci_tests():
    """A lower bound nobody runs is a guess: each one must be the lowest version some CI env pins."""
    declared = _declared()
    lowest: dict[str, Version] = {}
    for path in [ROOT / "constraints.txt", *ENVS]:
        for name, version in _pins(path)[1].items():
            lowest[name] = min(version, lowest.get(name, version))
    for name in SENSITIVE:
        assert _lower(declared[name]) == lowest[name], (name, str(declared[name]), str(lowest[name]))
    pythons = [Version(_pins(p)[0] or "0") for p in ENVS]
    pinned = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in pinned
    declared_python = _lower(SpecifierSet(PYPROJECT["project"]["requires-python"]))
    assert declared_python is not None and declared_python <= min(pythons)


def test_optional_extras_are_pinned_where_ci_installs_them():
    """An env's extras exist and each of their packages is pinned there; the pinned .venv and the
    required dependencies carry none of them (torchvision's wheels need PyPI's CUDA build of torch,
    the pinned .venv has the CPU build). Each extra's lower bounds are versions some env pins."""
    groups = PYPROJECT["project"]["optional-dependencies"]
    optional = {name for name in groups if name != "test"}
    assert "vision" in optional
    required = {canonicalize_name(Requirement(line).name) for line in PYPROJECT["project"]["dependencies"]}
    lowest: dict[str, Version] = {}
    for path in ENVS:
        pins = _pins(path)[1]
        for extra in _extras(path):
            assert extra in optional, f"{path.name} names extra {extra!r}, which pyproject.toml lacks"
            for line in groups[extra]:
                name = canonicalize_name(Requirement(line).name)
                assert name in pins, f"{path.name} installs {name} (extra {extra}) unpinned"
                lowest[name] = min(pins[name], lowest.get(name, pins[name]))
    assert {"gpu-image", "newest"} <= {p.stem for p in ENVS if "vision" in _extras(p)}
    pinned = _pins(ROOT / "constraints.txt")[1]
    for extra in optional:
        for line in groups[extra]:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            assert name not in required and name not in pinned, (extra, name)
            assert _lower(req.specifier) == lowest[name], (extra, line, str(lowest[name]))
    script = (ROOT / "scripts" / "test-env.sh").read_text()
    assert "# extras:" in script and "test${extras:+,$extras}" in script


def test_ci_runs_the_whole_suite_where_users_do():
    """The GPU image's users run the whole suite, so CI runs it there (``--all``); the other envs
    run the version-sensitive set, which holds the conformance suite (its lists carry version
    conditions that only a run in that env proves)."""
    run = (ROOT / ".ci" / "run").read_text()
    assert '[ "$name" = gpu-image ] && scope=(--all)' in run
    script = (ROOT / "scripts" / "test-env.sh").read_text()
    default = script.split("\ndefault=(", 1)[1].split("\n)", 1)[0].split()
    assert "tests/conformance" in default
    assert "tests/external/test_vision_sweep.py" in default  # slow, and no -m leaves it out there
    assert "-m pytest" in script and " -m \"" not in script and "-m '" not in script
    assert all((ROOT / path).exists() for path in default if not path.startswith(("-", "#")))
