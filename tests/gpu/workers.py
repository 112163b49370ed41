"""What each spawned rank runs in the GPU distributed tests (module level, so spawn can import it)."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path
from typing import Any


def serve_on_cuda(rank: int, world_size: int, port: int, case: dict[str, Any]) -> None:
    """Both ranks on ``cuda:0`` under gloo (activations through host memory): the ONNX Runtime
    ranks and the torch ranks run ``case``; the last rank writes its outputs."""
    import numpy as np
    import torch

    from placement.distributed import DistributedPipeline, DistributedRunner
    from tests.distributed.harness import init

    init(rank, world_size, port)
    # strict fp32, as the suite compares (ONNX Runtime's ranks are strict by default)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    results: dict[str, Any] = {}
    try:
        for kind, cls in (("ort", DistributedRunner), ("torch", DistributedPipeline)):
            runner = cls(case["path"], device="cuda:0")
            assert str(runner.device) == "cuda:0"
            inputs = list(np.load(case["inputs"]).values()) if runner.is_first else None
            out = runner.run(inputs)
            runner.barrier()
            if out is not None:
                results[kind] = out
            runner.close()
    except Exception:  # recorded for the test to show
        results["error"] = traceback.format_exc()
    with open(Path(case["outdir"]) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
