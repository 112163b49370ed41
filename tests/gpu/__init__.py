"""Tests that need a GPU (the ``gpu`` marker): every CUDA path, run for real.

They skip, saying why, on machines without one (``tests/conftest.py``). On a GPU machine
``bash scripts/gpu-test.sh`` runs the whole suite, these included.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import ort_cuda_available, torch_cuda_available

#: skip unless torch sees a CUDA GPU
needs_torch_cuda = pytest.mark.skipif(not torch_cuda_available(), reason="needs torch with a CUDA GPU")
#: skip unless ONNX Runtime's CUDAExecutionProvider can run on a GPU
needs_ort_cuda = pytest.mark.skipif(
    not ort_cuda_available(), reason="needs onnxruntime's CUDAExecutionProvider and a GPU"
)


def finishes_within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a thread of its own; fails the test, with every thread's traceback on
    stderr, when it has not returned after ``seconds`` (a deadlock), else returns its result."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test
            box["error"] = err

    thread = threading.Thread(target=target, name="gpu-test-deadline", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(f"did not finish within {seconds} s: deadlocked (every thread's traceback on stderr)")
    if "error" in box:
        raise box["error"]
    return box.get("value")
