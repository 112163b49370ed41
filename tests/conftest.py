"""Shared fixtures: tiny models from ``models/`` exported once per session; the ``gpu`` marker;
``PLACEMENT_TEST_THREADS`` (emulate a machine with that many cores)."""

from __future__ import annotations

import functools
import os

import pytest

import placement as pl


@functools.cache
def export_once(name: str) -> tuple[pl.Model, object, tuple]:
    from placement import models

    net, args = models.build(name, "tiny")
    return pl.from_torch(net, args), net, args


@pytest.fixture
def exported():
    """``exported(name) -> (model, module, args)``: a fresh copy of the model each call."""

    def get(name: str):
        model, net, args = export_once(name)
        return model.copy(), net, args

    return get


MODEL_NAMES = ["mlp", "resnet", "gpt", "unet"]


def torch_cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def ort_cuda_available() -> bool:
    """Whether ONNX Runtime can run on a GPU: its CUDAExecutionProvider and a GPU to run it on."""
    from placement.runtime.device_map import cuda_device_count

    return cuda_device_count("ort") > 0


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook (see _keep_xdist_groups)
def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip, saying why, where neither torch nor ONNX Runtime has a GPU; tests
    marked ``xdist_group`` keep their group under ``--dist loadgroup``."""
    _keep_xdist_groups(config, items)
    if torch_cuda_available() or ort_cuda_available():
        return
    reason = "needs a GPU: torch.cuda sees none and onnxruntime has no usable CUDA provider"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _keep_xdist_groups(config, items) -> None:
    """Give each ``xdist_group`` test the ``@group`` suffix that ``--dist loadgroup`` schedules by.

    pytest-xdist writes the suffix into ``item._nodeid``; pytest 9.2 keeps node ids in a
    structured ``item._id`` instead, so the suffix is lost and a module's tests spread over the
    workers, each building the module's fixtures (pytest-xdist#1386). Where the suffix did not
    take, write it the way this pytest stores ids; where it did (older pytest), do nothing.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
            continue
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(autouse=True, scope="session")
def _strict_fp32():
    """Tests compare GPU results with the CPU's or eager's in strict fp32: torch's TF32 off
    (ONNX Runtime's is off through ``Runner(precision="fp32")``, the default); a test that
    wants TF32 says so with ``placement.runtime.precision.torch_precision("tf32")``."""
    from placement.runtime.precision import torch_precision

    with torch_precision("fp32"):
        yield


#: ``PLACEMENT_TEST_THREADS=16`` runs the tests as on a 16-core machine: see :func:`_emulated_cores`.
THREADS_ENV = "PLACEMENT_TEST_THREADS"


def emulated_threads() -> int | None:
    """The core count ``PLACEMENT_TEST_THREADS`` asks to emulate (None: unset, the real machine)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise pytest.UsageError(f"{THREADS_ENV} must be a whole number of at least 1, got {raw!r}")
    return int(raw)


@pytest.fixture(autouse=True, scope="session")
def _emulated_cores():
    """With ``PLACEMENT_TEST_THREADS=n``: what a machine with ``n`` cores changes, on this one.
    Torch's intra-op threads (``torch.set_num_threads(n)``), ONNX Runtime sessions left to
    their default thread count (``threads=None``) get ``n`` intra-op threads, and the cores
    the thread cap counts (``usable_cores``) are ``n``. More threads split reductions
    differently, so results that were equal bit for bit on fewer cores may differ in the
    last bits: tests that compare runs must say their tolerance. Waiting threads sleep instead
    of spinning (ORT's ``allow_spinning``; give torch's ``OMP_WAIT_POLICY=PASSIVE``), which
    changes no result, only keeps n threads on fewer cores from starving each other."""
    n = emulated_threads()
    if n is None:
        yield
        return
    import torch

    from placement.runtime.ort import sessions

    original = sessions.session_options

    def session_options(physical, *, threads=None):
        options = original(physical, threads=n if threads is None else threads)
        # n threads spinning on fewer cores would starve each other: same results, waiting threads sleep
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return options

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sessions, "usable_cores", lambda: n)
        patch.setattr(sessions, "session_options", session_options)
        yield
    torch.set_num_threads(before)
