"""ONNX's node-level backend test suite as a conformance bar: load, run, compare.

The onnx wheel generates its whole node suite (``onnx.backend.test.case.node``):
each case is a one-op (sometimes a few ops) model with inputs and expected
outputs and the suite's tolerances. Generating it takes seconds, so the cases are
generated once and cached on disk (a pickle under the temp dir keyed by the onnx
version; ``PLACEMENT_CONFORMANCE_CACHE`` chooses another file), guarded by a file
lock so parallel pytest workers generate it only once.

A *runtime* is a function ``case -> outputs`` (outputs in graph-output order, as
ONNX Runtime returns them: numpy arrays, lists for sequences, ``None`` for an
empty optional). :func:`check` runs one and compares with :func:`compare`, which
follows ``onnx.backend.test.runner.Runner.assert_similar_outputs``.

Expected failures live next to the test modules in ``xfail_<runtime>.txt``, one
``case_name: reason`` a line, or ``case_name [onnx<1.18]: reason`` for an entry that
holds only where its version condition does (:mod:`tests.conformance._lists`; ``#``
comments allowed). Test modules mark the entries that hold strict xfail, so a case that
starts passing fails the run until it is removed. Regenerate a list (it only shrinks
unless ``--grow`` is given; reasons already written are kept); in another environment
than the pinned one, ``--where`` names what sets it apart, and its differences are
written as conditions::

    .venv/bin/python -m tests.conformance._cases ort placed_last placed_alternate
    .venv/bin/python -m tests.conformance._cases --grow torch   # also add new failures
    .venv-gpu-image/bin/python -m tests.conformance._cases --grow --where 'onnx<1.18' ort

Runtimes defined here: ``ort`` (one plain ``InferenceSession``), ``placed_last``
(``pl.run``, the model on logical devices 0 and 1 with the last op moved to 1,
copies injected), ``placed_alternate`` (every other op moved to device 1, so
copies sit on many edges), ``torch`` (``pl.to_torch`` on the CPU, forward only). Other
runtimes can be added with :func:`register`. ``placed_folded`` is ``placed_alternate`` with the
runner's default ``fold``: the two logical devices share the CPU, so they run as one session.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import importlib
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.conformance import _lists

HERE = Path(__file__).resolve().parent

Runtime = Callable[["Case"], list[Any]]


@dataclass(frozen=True)
class Case:
    """One node test case: the model (serialised ONNX), inputs and expected outputs.

    Attributes:
        name: the suite's name (``test_abs``).
        model_bytes: the serialised ``ModelProto``.
        input_names / output_names: graph inputs and outputs, in order.
        inputs: values in graph-input order (numpy arrays, lists for sequences,
            ``None`` or a value for optionals).
        outputs: expected values in graph-output order (same kinds).
        rtol, atol: the suite's tolerances for this case.
    """

    name: str
    model_bytes: bytes
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    rtol: float
    atol: float

    @property
    def model(self) -> Any:
        """A fresh ``onnx.ModelProto`` of the case."""
        import onnx

        return onnx.load_from_string(self.model_bytes)

    @property
    def feeds(self) -> dict[str, Any]:
        """Inputs by graph-input name."""
        return dict(zip(self.input_names, self.inputs))

    @property
    def tensors_only(self) -> bool:
        """True when every input and expected output is a plain (non-string) tensor: a numpy
        array, or a ``TensorProto`` (how the suite stores types numpy lacks, such as float8)."""
        return all(_is_tensor(v) for v in (*self.inputs, *self.outputs))


def _is_tensor(value: Any) -> bool:
    from onnx import TensorProto

    if isinstance(value, TensorProto):
        return value.data_type != TensorProto.STRING
    return isinstance(value, np.ndarray) and value.dtype != object


def as_array(value: Any) -> Any:
    """A ``TensorProto`` value as a numpy array (``ml_dtypes`` for bfloat16, float8 and int4);
    others unchanged."""
    from onnx import TensorProto, numpy_helper

    if isinstance(value, TensorProto):
        return _ml_typed(numpy_helper.to_array(value), value.data_type)
    return value


def _ml_typed(array: Any, data_type: int) -> Any:
    """``array`` as the ``ml_dtypes`` type of ONNX's ``data_type`` when it holds that type's
    bits under another numpy type: older onnx releases give bfloat16 as ``uint16`` and float8
    as their own one-field ``uint8`` types, newer ones ``ml_dtypes``; one representation here."""
    from onnx import TensorProto

    name = {
        TensorProto.BFLOAT16: "bfloat16",
        TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
        TensorProto.FLOAT8E4M3FNUZ: "float8_e4m3fnuz",
        TensorProto.FLOAT8E5M2: "float8_e5m2",
        TensorProto.FLOAT8E5M2FNUZ: "float8_e5m2fnuz",
    }.get(data_type)
    if name is None or not isinstance(array, np.ndarray) or array.dtype.name == name:
        return array
    import ml_dtypes

    target = np.dtype(getattr(ml_dtypes, name))
    return array.view(target) if array.dtype.itemsize == target.itemsize else array


# --- the suite --------------------------------------------------------------------------


def _cache_path() -> Path:
    import onnx

    env = os.environ.get("PLACEMENT_CONFORMANCE_CACHE")
    if env:
        return Path(env)
    return (
        Path(tempfile.gettempdir())
        / f"placement-conformance-v3-onnx{onnx.__version__}-py{sys.version_info[1]}.pkl"
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_suffix(path.suffix + ".lock")
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _generate() -> dict[str, Case]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        raw = collect_testcases(None)
    cases: dict[str, Case] = {}
    for tc in raw:
        model = tc.model
        ((inputs, outputs),) = tc.data_sets  # every node case has exactly one data set
        graph_inputs = [v.name for v in model.graph.input]
        init_names = {t.name for t in model.graph.initializer}
        graph_inputs = [n for n in graph_inputs if n not in init_names]
        types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
        output_names = [v.name for v in model.graph.output]
        cases[tc.name] = Case(
            name=tc.name,
            model_bytes=model.SerializeToString(),
            input_names=tuple(graph_inputs[: len(inputs)]),
            output_names=tuple(output_names),
            inputs=tuple(_as_arrays(v, types.get(n, 0)) for v, n in zip(inputs, graph_inputs)),
            outputs=tuple(_as_arrays(v, types.get(n, 0)) for v, n in zip(outputs, output_names)),
            rtol=float(tc.rtol),
            atol=float(tc.atol),
        )
    return cases


def _as_arrays(value: Any, data_type: int) -> Any:
    """Numpy scalars as 0-d arrays (as the suite's .pb files hold them), inside sequences too;
    arrays of the graph's declared ``data_type`` (a tensor's element type) as :func:`_ml_typed`."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, list):
        return [_as_arrays(v, 0) for v in value]
    return _ml_typed(value, data_type)


@functools.cache
def cases() -> dict[str, Case]:
    """Every node case by name (generated once, then read from the disk cache)."""
    path = _cache_path()
    with _locked(path):
        if path.exists():
            try:
                with open(path, "rb") as handle:
                    return pickle.load(handle)
            except Exception:  # a stale or truncated cache: generate again
                pass
        found = _generate()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as handle:
            pickle.dump(found, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return found


def case_names() -> list[str]:
    """Every case name, sorted."""
    return sorted(cases())


# --- comparing --------------------------------------------------------------------------


def compare(case: Case, actual: list[Any]) -> None:
    """Assert ``actual`` equals the case's expected outputs within its tolerances.

    Same rules as ONNX's backend runner: same number of outputs; sequences
    element by element; an empty optional (``None``) only equals ``None``; same
    shape; strings exactly; otherwise same dtype and ``assert_allclose`` with the
    case's ``rtol``/``atol`` (NaNs equal; bfloat16 compared as float32 with two
    bfloat16 ULPs of relative tolerance).
    """
    assert len(actual) == len(case.outputs), f"{len(actual)} outputs, expected {len(case.outputs)}"
    for i, (got, want) in enumerate(zip(actual, case.outputs)):
        _compare_value(got, want, case.rtol, case.atol, f"output {i} ({case.output_names[i]!r})")


def _compare_value(got: Any, want: Any, rtol: float, atol: float, where: str) -> None:
    if want is None:
        assert got is None, f"{where}: expected an empty optional, got {type(got).__name__}"
        return
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)), f"{where}: expected a sequence, got {type(got).__name__}"
        assert len(got) == len(want), f"{where}: sequence of {len(got)}, expected {len(want)}"
        for j, (g, w) in enumerate(zip(got, want)):
            _compare_value(g, w, rtol, atol, f"{where}[{j}]")
        return
    want = np.asarray(as_array(want))
    assert isinstance(got, np.ndarray), f"{where}: expected an array, got {type(got).__name__}"
    assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
    if want.dtype == object or want.dtype.kind in "US":
        np.testing.assert_array_equal(got, want, err_msg=where)
        return
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)
    if got.dtype.kind not in "biufc":  # float8 / int4 and other ml_dtypes: compare as float32
        got, want = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=where)


# --- runtimes ---------------------------------------------------------------------------

_RUNTIMES: dict[str, Runtime] = {}


def register(name: str, runtime: Runtime) -> Runtime:
    """Register ``runtime`` under ``name`` (for :func:`check`, :func:`failures` and the CLI)."""
    _RUNTIMES[name] = runtime
    return runtime


def runtime(name: str) -> Runtime:
    """The runtime registered under ``name``."""
    return _RUNTIMES[name]


def _session_options() -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return options


def run_ort(case: Case) -> list[Any]:
    """The case in one plain ONNX Runtime CPU session (the ceiling of this ORT build)."""
    import onnxruntime as ort

    session = ort.InferenceSession(case.model_bytes, _session_options(), providers=["CPUExecutionProvider"])
    feeds = ort_feeds(case)
    if not _numpy_lacks_an_output(case):
        return session.run(None, feeds)
    values = {
        n: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v) for n, v in feeds.items()
    }
    return from_ort_values(case, session.run_with_ort_values(None, values))


def place(case: Case, how: str) -> Any:
    """The case as a ``placement.Model`` on logical devices 0 and 1, copies injected.

    ``how``: ``"last"`` moves the last op to device 1; ``"alternate"`` moves
    every other op (the 2nd, 4th, ...), or the only op when there is one.
    """
    import placement as pl

    model = pl.load(case.model, device=0)
    ops = model.ops
    if how == "last":
        moved = ops[-1:]
    elif how == "alternate":
        moved = ops[1::2] if len(ops) > 1 else ops
    else:
        raise ValueError(f"unknown placement {how!r}")
    for op in moved:
        model.set_device(op.name, 1)
    pl.inject_cross_device_copies(model)
    return model


def run_placed(case: Case, how: str, fold: bool | None = False) -> list[Any]:
    """``pl.run`` on :func:`place` (``how``), the logical devices on the CPU: each stage a session
    of its own (``fold=False``), or, with ``fold=None`` (the runner's default), folded into one."""
    import placement as pl

    model = place(case, how)
    runner = pl.Runner(model, threads=1, device_map="cpu", fold=fold)
    if not _numpy_lacks_an_output(case):
        return runner.run(ort_feeds(case))
    return from_ort_values(case, runner.run(ort_feeds(case), outputs="ortvalue"))


def ort_feeds(case: Case) -> dict[str, Any]:
    """The case's inputs as ONNX Runtime takes them, by graph-input name.

    Newer onnx releases store some inputs as ``TensorProto`` s, which ONNX Runtime does not
    take: a numpy type becomes its array; a type numpy lacks (bfloat16, float8, 4- and 2-bit
    types, held as ``ml_dtypes``, as older releases' inputs are once read) an ``OrtValue`` of
    the same bits, the sub-byte types packed as ONNX stores them (the first element in the
    lowest bits).
    """
    types = {v.name: v.type.tensor_type.elem_type for v in case.model.graph.input}
    return {name: _ort_input(value, types.get(name, 0)) for name, value in case.feeds.items()}


def _ort_input(value: Any, data_type: int) -> Any:
    from onnx import TensorProto

    if isinstance(value, TensorProto):
        data_type = value.data_type
    array = as_array(value)
    if not isinstance(array, np.ndarray) or _numpy_has(array.dtype) or array.dtype == object or not data_type:
        return array
    import onnxruntime as ort

    width = _SUB_BYTE_WIDTH.get(data_type)
    bits = array.view(np.uint8 if array.dtype.itemsize == 1 else np.uint16)
    if width is not None:
        bits = _packed(bits, width)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(bits), data_type)


def _numpy_has(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of numpy's own types (not an ``ml_dtypes`` one)."""
    return dtype.kind in "biufc?" and dtype.type.__module__ == "numpy"


def _numpy_lacks_an_output(case: Case) -> bool:
    """Whether an expected output is a tensor of a type numpy lacks (ONNX Runtime's ``run``
    cannot hand such outputs back: they come back as ``OrtValue`` s)."""
    expected = [as_array(v) for v in case.outputs]
    return any(isinstance(v, np.ndarray) and not _numpy_has(v.dtype) and v.dtype != object for v in expected)


def from_ort_values(case: Case, values: list[Any]) -> list[Any]:
    """``OrtValue`` outputs as numpy arrays; those of types numpy lacks read bit for bit as
    the expected output's ``ml_dtypes`` type (the sub-byte types unpacked)."""
    out = []
    for value, want in zip(values, case.outputs):
        want = as_array(want)
        if not isinstance(want, np.ndarray) or _numpy_has(want.dtype) or want.dtype == object:
            out.append(value.numpy())
            continue
        import ctypes

        raw = np.frombuffer(ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes()), np.uint8)
        shape = tuple(value.shape())
        width = 8 * want.dtype.itemsize if not want.dtype.name.startswith(("int", "uint", "float4")) else None
        out.append(_from_bits(raw, shape, want.dtype, width))
    return out


def _from_bits(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, width: int | None) -> np.ndarray:
    """ONNX Runtime's bytes of a tensor of ``dtype`` (an ``ml_dtypes`` type) as an array."""
    if width is not None:  # bfloat16 and float8: whole bytes
        return raw.view(np.uint8 if width == 8 else np.uint16).reshape(shape).view(dtype)
    bits = 2 if dtype.name.endswith("2") else 4
    per = 8 // bits
    count = int(np.prod(shape, dtype=np.int64))
    codes = ((raw[:, None] >> (np.arange(per, dtype=np.uint8) * bits)) & ((1 << bits) - 1)).reshape(-1)[
        :count
    ]
    if dtype.name.startswith("int"):  # two's complement in ``bits`` bits
        return (
            np.where(codes >= 1 << (bits - 1), codes.astype(np.int16) - (1 << bits), codes)
            .astype(dtype)
            .reshape(shape)
        )
    return (
        codes.astype(np.uint8).view(dtype).reshape(shape)
        if dtype.name.startswith("float")
        else codes.astype(dtype).reshape(shape)
    )


#: Bits per element of ONNX's sub-byte types (those the installed onnx knows).
_SUB_BYTE_WIDTH = {
    code: width
    for name, width in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if (code := getattr(__import__("onnx").TensorProto, name, None)) is not None
}


def _packed(bits: np.ndarray, width: int) -> np.ndarray:
    """One byte per element -> ``8 // width`` elements per byte, in an array of the original
    shape (ONNX Runtime reads the packed bytes from its start: the tensor's size in bytes)."""
    per = 8 // width
    flat = bits.reshape(-1) & ((1 << width) - 1)
    flat = np.concatenate([flat, np.zeros(-flat.size % per, np.uint8)]).reshape(-1, per).astype(np.uint16)
    packed = (flat << (np.arange(per, dtype=np.uint16) * width)).sum(axis=1).astype(np.uint8)
    out = np.zeros(bits.shape, np.uint8)
    out.reshape(-1)[: packed.size] = packed
    return out


#: ``ml_dtypes`` names of the numpy types torch holds under the same bits.
_ML_DTYPES = {
    "bfloat16": ("bfloat16", np.uint16),
    "float8_e4m3fn": ("float8_e4m3fn", np.uint8),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", np.uint8),
    "float8_e5m2": ("float8_e5m2", np.uint8),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", np.uint8),
}


def to_tensor(value: Any) -> Any:
    """A case value as a torch tensor (``ml_dtypes`` arrays reinterpreted bit for bit).

    Raises:
        TypeError: a type torch has no tensors of (int4, float4, ...).
    """
    import torch

    array = np.array(as_array(value))  # writable and owning
    if array.dtype.name in _ML_DTYPES:
        name, bits = _ML_DTYPES[array.dtype.name]
        return torch.from_numpy(array.view(bits)).view(getattr(torch, name))
    if array.dtype.kind not in "biufc":
        raise TypeError(f"torch has no tensors of numpy type {array.dtype.name}")
    return torch.from_numpy(array)


def from_tensor(tensor: Any) -> np.ndarray:
    """A torch tensor as a numpy array (``ml_dtypes`` for bfloat16 and float8)."""
    tensor = tensor.detach().cpu()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _ML_DTYPES:
        import ml_dtypes

        _, bits = _ML_DTYPES[name]
        import torch

        return (
            tensor.view(torch.uint8 if bits is np.uint8 else torch.uint16)
            .numpy()
            .view(getattr(ml_dtypes, name))
        )
    return tensor.numpy()


def run_torch(case: Case) -> list[Any]:
    """``pl.to_torch`` of the case (one device, on the CPU), called on the case's inputs
    (forward only; plain tensors only: the lowering takes no sequences or strings)."""
    import placement as pl

    module = pl.to_torch(pl.load(case.model), device_map="cpu")
    got = module(*[to_tensor(x) for x in case.inputs])
    return [from_tensor(t) for t in (got if isinstance(got, tuple) else (got,))]


register("ort", run_ort)
register("torch", run_torch)
register("placed_last", functools.partial(run_placed, how="last"))
register("placed_alternate", functools.partial(run_placed, how="alternate"))
register("placed_folded", functools.partial(run_placed, how="alternate", fold=None))


def check(case: Case, runtime_name: str) -> None:
    """Run ``case`` on the named runtime and compare (raises on any difference or error)."""
    outputs = _RUNTIMES[runtime_name](case) if runtime_name in _RUNTIMES else runtime(runtime_name)(case)
    compare(case, list(outputs))


def run_case(name: str, runtime_name: str) -> None:
    """The body of a conformance test: fail with the one-line reason (no traceback:
    rendering tracebacks of hundreds of expected failures would cost more than running them)."""
    import pytest

    reason = outcome(cases()[name], runtime_name)
    if reason is not None:
        pytest.fail(reason, pytrace=False)


def outcome(case: Case, runtime_name: str) -> str | None:
    """None when the case passes on the runtime, else a one-line reason."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            check(case, runtime_name)
    except Exception as err:  # any failure is a reason (AssertionError, ORT errors, ...)
        return _reason(err)
    return None


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if isinstance(err, AssertionError):
        text = text.replace("Not equal to tolerance", "values differ")
        prefix = "wrong result"
    else:
        prefix = type(err).__name__
    return f"{prefix}: {text}"[:200].rstrip()


# --- expected-failure lists (tests/conformance/_lists.py: conditions per environment) ----

xfail_path = _lists.xfail_path
MACHINE_DEPENDENT = _lists.MACHINE_DEPENDENT


def expected_failures(runtime_name: str) -> dict[str, str]:
    """``case -> reason`` of the listed entries that hold in this environment (their version
    condition holds) for cases the installed onnx generates."""
    present = cases()
    return {n: why for n, why in _lists.applicable(runtime_name).items() if n in present}


def expected_failures_here(runtime_name: str) -> dict[str, str]:
    """:func:`expected_failures` less the machine-dependent ones this machine lets pass."""
    present = cases()
    return {n: why for n, why in _lists.expected_here(runtime_name).items() if n in present}


def params(runtime_name: str) -> list[Any]:
    """``pytest.param`` per case, strict xfail (with its reason) where an entry holds in this
    environment and the case is expected to fail on this machine (see :data:`MACHINE_DEPENDENT`)."""
    import pytest

    here = expected_failures_here(runtime_name)
    names = case_names()
    out = [
        pytest.param(name, marks=pytest.mark.xfail(reason=here[name], strict=True), id=name)
        if name in here
        else pytest.param(name, id=name)
        for name in names
    ]
    for name in _lists.stale(runtime_name, set(names)):  # fails the run: the list stays honest
        out.append(pytest.param(name, id=name))
    return out


def failures(runtime_name: str, names: list[str] | None = None) -> dict[str, str]:
    """Run the named cases (default: all) and return the failing ones with reasons."""
    all_cases = cases()
    result = {}
    for name in names if names is not None else sorted(all_cases):
        reason = outcome(all_cases[name], runtime_name) if name in all_cases else "not in the suite"
        if reason is not None:
            result[name] = reason
    return result


_HEADER = """Expected failures of the {runtime} runtime on ONNX's node test suite.
suite: onnx {onnx}
One `case: reason` a line, `case [condition]: reason` where it holds only in some environments
(tests/conformance/_lists.py); the test module runs those that hold as strict xfail.
Regenerate (only removes cases that now pass; --grow also adds new failures; in another
environment --where names it, e.g. --where 'onnx<1.18'):
    .venv/bin/python -m tests.conformance._cases {runtime}"""


def _regenerate(name: str, now: dict[str, str], grow: bool, where: str | None) -> dict[str, _lists.Entry]:
    """The new entries of ``name``'s list from this environment's failures ``now``.

    Without ``where`` (the environment the list is reviewed in): applicable entries that
    pass are dropped, ``grow`` adds new failures unconditionally. With ``where`` (a
    requirement that holds here, such as ``onnx<1.18``): unconditional entries that pass
    here get the complement condition, entries made for ``where`` that pass are dropped,
    and ``grow`` adds new failures under ``where``. Entries for cases not generated here,
    or whose condition does not hold here, are kept as they are; contradictions are printed.
    """
    old = _lists.entries(name)
    keep: dict[str, _lists.Entry] = {}
    present = cases()
    for case, entry in old.items():
        failing = case in now
        if case not in present or _lists.needs(entry.reason) is not None:
            keep[case] = entry  # another suite's case, or passes or fails by machine
        elif not _lists.holds(entry.condition):
            keep[case] = entry
            if failing and where is not None and entry.condition == _lists.complement(where):
                keep[case] = _lists.Entry(entry.reason)  # fails on both sides: everywhere
            elif failing:
                print(f"{name}: {case} fails here, outside its condition [{entry.condition}]: review")
        elif failing:
            keep[case] = entry
        elif where is not None and entry.condition is None:
            keep[case] = _lists.Entry(entry.reason, _lists.complement(where))
        elif where is not None and entry.condition != where:
            keep[case] = entry
            print(f"{name}: {case} passes here, inside its condition [{entry.condition}]: review")
    new = sorted(set(now) - set(keep))
    if grow:
        keep.update({case: _lists.Entry(now[case], where) for case in new})
    elif new:
        print(f"{name}: {len(new)} failing cases are not listed (run with --grow to add): {new[:10]}")
    return keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.conformance._cases", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "runtimes", nargs="+", help="runtime names (ort, placed_last, placed_alternate, placed_folded, torch)"
    )
    parser.add_argument("--grow", action="store_true", help="also add cases that fail now (review them)")
    parser.add_argument(
        "--where", help="this environment, as a requirement that holds here and not where the list "
        "was reviewed (e.g. 'onnx<1.18'): its differences get version conditions"
    )  # fmt: skip
    args = parser.parse_args(argv)
    import onnx

    if args.where is not None and not _lists.holds(args.where):
        parser.error(f"--where {args.where!r} does not hold here")
    for name in args.runtimes:
        start = time.perf_counter()
        if name == "torch":  # the test module's runtime: outputs and a backward pass
            importlib.import_module("tests.conformance.test_torch")
        runtime(name)
        now = failures(name)
        old = _lists.entries(name)
        keep = _regenerate(name, now, args.grow or not old, args.where)
        suite = _lists.suite_release(name) if args.where else None
        _lists.write(name, keep, _HEADER.format(runtime=name, onnx=suite or onnx.__version__))
        total = len(cases())
        print(
            f"{name}: {total - len(now)}/{total} pass; {len(keep)} listed "
            f"({len(set(old) - set(keep))} removed) in {time.perf_counter() - start:.1f} s"
        )
    return 0


if __name__ == "__main__":  # run as the package's module, where the test modules register
    from tests.conformance import _cases

    raise SystemExit(_cases.main())
