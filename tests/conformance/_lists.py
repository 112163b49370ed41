"""The conformance suite's expected-failure lists (``xfail_<runtime>.txt``), per environment.

One entry a line, ``case_name: reason``, or ``case_name [condition]: reason`` for an
entry that holds only in some environments. A condition is one or more version
requirements separated by ``;``, all of which must hold, each a distribution and a
PEP 440 specifier (``onnx<1.18``, ``torch>=2.15``, ``onnx>=1.18; torch<2.15``),
compared with the installed ``__version__`` of that module (``onnxruntime`` whatever
wheel provides it)::

    test_mod_uint8 [onnx>=1.18]: Fail: ... (onnx 1.18 writes this case at an opset ORT lacks)
    test_qlinearmatmul_2D_int8_float32 [onnx<1.18]: wrong result: ... (onnx 1.17's expected values)

An entry whose condition holds is a strict xfail, so a listed case that passes fails the
run in every environment the entry speaks for. The node cases come from the installed
onnx wheel: the ``# suite: onnx X.Y.Z`` header line names the release the list was
reviewed against. A listed case that the installed suite lacks fails the run under that
release or a newer one (the list must not keep entries for cases ONNX dropped); under an
older onnx it is simply not generated there, and its entry is ignored.

    >>> parse_line("test_abs [onnx<1.18; torch>=2.15]: wrong result")
    ('test_abs', 'onnx<1.18; torch>=2.15', 'wrong result')
    >>> complement("onnx<1.18")
    'onnx>=1.18'
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

HERE = Path(__file__).resolve().parent

_REQUIREMENT = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_.-]*)\s*((?:[<>=!~]=?|===)\s*[^<>=!~;]+.*)$")
_SUITE = re.compile(r"^#\s*suite:\s*onnx\s+(\S+)")
_OPPOSITE = {"<": ">=", ">=": "<", ">": "<=", "<=": ">", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Entry:
    """One listed case: why it fails, and where (``condition``; None: everywhere)."""

    reason: str
    condition: str | None = None


def parse_line(line: str) -> tuple[str, str | None, str]:
    """``(case, condition or None, reason)`` of one list line."""
    head, _, reason = line.partition(":")
    head = head.strip()
    condition = None
    if head.endswith("]") and "[" in head:
        head, _, condition = head[:-1].partition("[")
        head, condition = head.strip(), condition.strip()
        _requirements(condition)  # a malformed condition fails loudly where the list is read
    return head, condition, reason.strip()


@functools.cache
def installed(dist: str) -> Version:
    """The installed version of ``dist`` (the module's ``__version__``, local label dropped)."""
    module = importlib.import_module(dist.replace("-", "_"))
    return Version(Version(module.__version__).public)


def _requirements(condition: str) -> list[tuple[str, SpecifierSet]]:
    out = []
    for part in condition.split(";"):
        match = _REQUIREMENT.match(part)
        if match is None:
            raise ValueError(f"conformance list condition {part.strip()!r}: expected e.g. 'onnx<1.18'")
        out.append((match.group(1), SpecifierSet(match.group(2).replace(" ", ""))))
    return out


def holds(condition: str | None) -> bool:
    """Whether ``condition`` holds in this environment (None always holds)."""
    if condition is None:
        return True
    return all(spec.contains(installed(dist), prereleases=True) for dist, spec in _requirements(condition))


def complement(requirement: str) -> str:
    """The requirement that holds exactly where the one-specifier ``requirement`` does not."""
    ((dist, spec),) = _requirements(requirement)
    (one,) = spec
    if one.operator not in _OPPOSITE:
        raise ValueError(f"{requirement!r}: only <, <=, >, >=, ==, != have a complement")
    return f"{dist}{_OPPOSITE[one.operator]}{one.version}"


def xfail_path(runtime_name: str) -> Path:
    """Where the expected failures of ``runtime_name`` are listed."""
    return HERE / f"xfail_{runtime_name}.txt"


def entries(runtime_name: str) -> dict[str, Entry]:
    """Every entry of ``xfail_<runtime>.txt``, conditions unevaluated (empty when there is none)."""
    path = xfail_path(runtime_name)
    if not path.exists():
        return {}
    found: dict[str, Entry] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, condition, reason = parse_line(line)
            found[name] = Entry(reason, condition)
    return found


def suite_release(runtime_name: str) -> Version | None:
    """The onnx release whose node cases the list was reviewed against (its ``# suite:`` line)."""
    path = xfail_path(runtime_name)
    for line in path.read_text().splitlines() if path.exists() else []:
        if match := _SUITE.match(line):
            return Version(match.group(1))
    return None


def applicable(runtime_name: str) -> dict[str, str]:
    """``case -> reason`` of the entries whose condition holds here (present in the suite or not)."""
    return {n: e.reason for n, e in entries(runtime_name).items() if holds(e.condition)}


def stale(runtime_name: str, present: set[str]) -> list[str]:
    """Applicable entries naming a case the installed suite (``present``) lacks, where that is
    an error: under the list's suite release or a newer onnx."""
    release = suite_release(runtime_name)
    if release is not None and installed("onnx") < release:
        return []
    return sorted(set(applicable(runtime_name)) - present)


def write(runtime_name: str, listed: dict[str, Entry], header: str) -> None:
    """Write ``xfail_<runtime>.txt`` sorted by name, with ``header`` as ``#`` comments."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name in sorted(listed):
        entry = listed[name]
        condition = f" [{entry.condition}]" if entry.condition else ""
        lines.append(f"{name}{condition}: {entry.reason}")
    xfail_path(runtime_name).write_text("\n".join(lines) + "\n")


@functools.cache
def ort_default_locale() -> bool:
    """Whether ONNX Runtime's ``StringNormalizer`` can build its default locale here.

    With a case change and no ``locale`` attribute it constructs the C++ locale
    ``en_US.UTF-8`` (on Linux) by name, which exists only where that locale is
    installed (``locale -a``); ``LANG`` and ``LC_ALL`` do not matter. Asked of ONNX
    Runtime itself: a one-op model, one session.
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="LOWER")
    graph = helper.make_graph(
        [node],
        "locale_probe",
        [helper.make_tensor_value_info("x", TensorProto.STRING, [1])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)], ir_version=7)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4  # the failure is the answer, not an error to log
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ORT raises its own Fail type
        return False
    return True


#: Listed failures that depend on the machine, not on the runtime: a fragment of their
#: reason -> (whether this machine has what they need, what that is). Where it has it, the
#: case runs as an ordinary test (it must pass); elsewhere it stays a strict xfail.
#: Regenerating a list keeps these entries, passing or not.
MACHINE_DEPENDENT: dict[str, tuple[Callable[[], bool], str]] = {
    "StringNormalizer::Locale": (ort_default_locale, "the en_US.UTF-8 locale installed"),
}


def needs(reason: str) -> tuple[Callable[[], bool], str] | None:
    """What a machine-dependent entry needs (see :data:`MACHINE_DEPENDENT`), else None."""
    return next((need for fragment, need in MACHINE_DEPENDENT.items() if fragment in reason), None)


def expected_here(runtime_name: str) -> dict[str, str]:
    """:func:`applicable` less the machine-dependent ones this machine lets pass."""
    return {
        name: why
        for name, why in applicable(runtime_name).items()
        if (need := needs(why)) is None or not need[0]()
    }
