"""Distributed ranks on a GPU: two ranks of ONNX Runtime stage sessions, and two torch ranks,
both on ``cuda:0`` (gloo, activations through host memory), equal ``pl.run`` on the CPU."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import placement as pl
from placement.runtime.precision import FP32_TOLERANCE
from tests.distributed.harness import spawn
from tests.distributed.test_torch_ranks import place
from tests.gpu import needs_ort_cuda, needs_torch_cuda, workers

pytestmark = [pytest.mark.gpu, needs_ort_cuda, needs_torch_cuda]


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_two_ranks_sharing_one_gpu_equal_pl_run(tmp_path, name):
    model, batch = place(name, 2)
    model.save(tmp_path / "placed.onnx")
    np.savez(tmp_path / "inputs.npz", *batch)
    case = {
        "path": str(tmp_path / "placed.onnx"),
        "inputs": str(tmp_path / "inputs.npz"),
        "outdir": str(tmp_path),
    }
    codes = spawn(workers.serve_on_cuda, 2, case, timeout=240)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert codes == {0: 0, 1: 0} and not any("error" in r for r in results), results
    rows = model.graph.inputs[0].shape[0]
    parts = [
        pl.run(model, [a[i : i + rows] for a in batch], device_map="cpu")
        for i in range(0, len(batch[0]), rows)
    ]
    want = [np.concatenate(p) for p in zip(*parts)]
    for kind in ("ort", "torch"):
        got = results[1][kind]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=FP32_TOLERANCE.rtol, atol=FP32_TOLERANCE.atol, err_msg=kind)
