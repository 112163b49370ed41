"""A model over 2 GiB end to end: load lazily, place, save, run in both runtimes.

The model (``placement.models.synthetic``: ten 8192 x 8192 float32 MatMuls,
2.5 GiB of weights in one external data file) is written by the test. It is
marked ``slow`` (CI runs it in a step of its own) and skips itself without the memory
and disk it needs (see ``_SKIP``); it takes two to four minutes on two busy cores, most
of it writing 5 GiB to disk, which it deletes when it ends, passed or failed (pytest keeps
the temporary folders of its last three runs, and three runs' 5 GiB would fill a CI disk).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import onnx_ir as ir
import pytest

import placement as pl

_GIB = 2**30
_NEEDS_MEMORY = 12 * _GIB
_NEEDS_DISK = 8 * _GIB


def _available_memory() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _skip_reason() -> str | None:
    if not os.path.exists("/proc/meminfo"):
        return "needs Linux /proc to measure memory"
    memory = _available_memory()
    if memory < _NEEDS_MEMORY:
        return f"needs {_NEEDS_MEMORY / _GIB:.0f} GiB of available memory, {memory / _GIB:.1f} GiB available"
    disk = shutil.disk_usage(tempfile.gettempdir()).free
    if disk < _NEEDS_DISK:
        free = f"{disk / _GIB:.1f} GiB free"
        return f"needs {_NEEDS_DISK / _GIB:.0f} GiB of free disk in {tempfile.gettempdir()}, {free}"
    return None


_SKIP = _skip_reason()
pytestmark = [
    pytest.mark.bigmodel,
    pytest.mark.slow,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]

# load + shift + inject + save in a fresh process, so its peak resident memory is
# the pipeline's own (the last layer moves to cuda:1).
_PLACE = textwrap.dedent(
    """
    import json, sys
    import placement as pl
    source, target = sys.argv[1], sys.argv[2]
    model = pl.load(source)
    acts = pl.get_activation_blobs(model)
    pl.shift_activation_devices(model, acts[-2:], {0: 1})
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    model.save(target)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024}))
    """
)


@pytest.fixture
def big_dir(tmp_path):
    """``tmp_path``, emptied when the test ends (its 5 GiB must not outlive the run)."""
    try:
        yield tmp_path
    finally:
        gc.collect()  # close memory maps of the external data before the files go
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_2_5_gib_model_loads_places_saves_and_runs(big_dir):
    tmp_path = big_dir
    import onnxruntime as ort
    import torch

    from placement.models.synthetic import write_matmul_chain

    source = tmp_path / "big.onnx"
    weight_bytes = write_matmul_chain(source, layers=10, width=8192)
    assert weight_bytes == 10 * 8192 * 8192 * 4 > 2**31

    placed_path = tmp_path / "placed.onnx"
    done = subprocess.run(
        [sys.executable, "-c", _PLACE, str(source), str(placed_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    assert peak < 1.2 * weight_bytes, f"peak RSS {peak / _GIB:.2f} GiB for {weight_bytes / _GIB:.2f} GiB"

    x = np.random.default_rng(1).standard_normal((2, 8192), dtype=np.float32)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    del session
    gc.collect()

    placed = pl.load(placed_path)  # the saved pair: devices restored, the very same weights
    assert [str(d) for d in placed.devices] == ["cuda:0", "cuda:1"]
    for name in ("w0", "w9"):
        saved, original = placed.graph.initializers[name].const_value, onnx_weight(source, name)
        assert isinstance(saved, ir.ExternalTensor) and np.array_equal(saved.numpy(), original)
    del placed
    gc.collect()

    # auto_place with timed profiling; cuda:1 may hold one layer, so cuda:0's stage holds
    # 2.25 GiB of weights: a stage over protobuf's 2 GiB limit.
    model = pl.load(source)
    plan = pl.auto_place(model, devices=2, max_memory={1: "300MiB"}, repeats=1)
    assert plan.cost_kind == "time" and [str(d) for d in model.devices] == ["cuda:0", "cuda:1"]
    runner = pl.Runner(model, device_map="cpu", fold=False)  # a stage per device
    stage_weights = [
        sum(model.graph.initializers[p].const_value.nbytes for p in s.parameters) for s in runner.stages
    ]
    assert stage_weights == [9 * 2**28, 2**28]
    np.testing.assert_allclose(runner.run({"x": x})[0], want, rtol=1e-4, atol=1e-5)
    del runner
    gc.collect()

    module = pl.to_torch(model, device_map="cpu")
    with torch.no_grad():
        out = module(torch.from_numpy(x))
    out = out[0] if isinstance(out, (tuple, list)) else out
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-5)


def onnx_weight(path, name):
    """One weight of the source file, read from its external data with numpy (no placement code)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    info = {e.key: e.value for e in tensor.external_data}
    return np.fromfile(
        path.parent / info["location"],
        dtype=np.float32,
        count=int(info["length"]) // 4,
        offset=int(info["offset"]),
    ).reshape(tuple(tensor.dims))
