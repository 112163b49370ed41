"""What each spawned rank of the 2D (tensor inside pipeline) tests runs (module level, for spawn)."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from tests.distributed.tp_workers import cross_entropy


def gpt_grid(
    rank: int, world_size: int, port: int, path: str, dynamic: str, inputs: str, outdir: str
) -> None:
    """A 2D-split gpt on a grid of ranks: runs of 1 and 2 micro-batches, then a GPipe training
    step of 2 micro-batches; then the same split exported with a dynamic batch, one 1F1B
    training step of 2 micro-batches. Every rank saves what it saw."""
    from placement.distributed import DistributedTensorPipeline
    from tests.distributed.harness import init

    init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        data = np.load(inputs)
        idx, target = data["idx"], data["target"]
        with DistributedTensorPipeline(path, loss_fn=cross_entropy) as pipe:
            results["place"] = (pipe.position, pipe.index, pipe.is_last)
            results["collectives"] = [(s.kind, s.id, s.dangling) for s in pipe.grid_stage.collectives]
            results["shared"] = dict(pipe.grid_stage.shared_parameters)
            half = len(idx) // 2
            for name, rows in (("out/1", idx[:half]), ("out/2", idx)):
                out = pipe.run([rows] if pipe.is_first else None)
                if out is not None:
                    results[name] = out[0]
            loss = pipe.train_step([idx] if pipe.is_first else None, target if pipe.is_last else None)
            if loss is not None:
                results["loss"] = float(loss)
            results["grads"] = {name: p.grad.numpy().copy() for name, p in pipe.named_parameters()}
            pipe.barrier()
        with DistributedTensorPipeline(dynamic, schedule="1f1b", chunks=2, loss_fn=cross_entropy) as pipe:
            loss = pipe.train_step([idx] if pipe.is_first else None, target if pipe.is_last else None)
            if loss is not None:
                results["1f1b/loss"] = float(loss)
            results["1f1b/grads"] = {name: p.grad.numpy().copy() for name, p in pipe.named_parameters()}
            pipe.barrier()
    except BaseException:  # the test reads the traceback
        results["error"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
