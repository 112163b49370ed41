"""What each spawned rank runs in the distributed tests (module level, so spawn can import it)."""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np


def _mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def zoo(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], outdir: str) -> None:
    """Inference and training cases on 3 ranks (world) or 2 ranks (the subgroup of ranks 0 and 1)."""
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, WorldSizeError
    from tests.distributed.harness import init

    init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        pair = dist.new_group([0, 1])
        for case in cases:
            n, key = case["ranks"], case["key"]
            group = None if n == world_size else pair
            if n < world_size and rank >= n:
                continue
            if "runs" in case:  # one pipeline, several runs of different rows
                with DistributedPipeline(case["path"], group=group) as pipe:
                    for i, run in enumerate(case["runs"]):
                        idx = np.load(run["inputs"]) if pipe.is_first else None
                        out = pipe.run([idx] if idx is not None else None, chunks=run["chunks"])
                        if out is not None:
                            results[f"{key}/out/{i}"] = out[0]
                continue
            training = "target" in case
            pipe = DistributedPipeline(
                case["path"], group=group, schedule=case.get("schedule", "gpipe"), loss_fn=_mse
            )
            with pipe:
                inputs = list(np.load(case["inputs"]).values()) if pipe.is_first else None
                if training:
                    target = np.load(case["target"]) if pipe.is_last else None
                    loss = pipe.train_step(inputs, target)
                    grads = {name: p.grad.numpy().copy() for name, p in pipe.named_parameters()}
                    results[f"{key}/grads/{rank}"] = grads
                    if loss is not None:
                        results[f"{key}/loss"] = float(loss)
                else:
                    out = pipe.run(inputs)
                    kept = [a.copy() for a in out] if out is not None else None
                    pipe.run(inputs)  # a later run must not overwrite the arrays handed out
                    if out is not None:
                        results[f"{key}/out"] = out
                        results[f"{key}/kept"] = all(np.array_equal(a, k) for a, k in zip(out, kept))
        # the world has 3 ranks; a 2-device placement on it is refused, naming both numbers
        try:
            DistributedPipeline(cases[0]["path2"])
        except WorldSizeError as err:
            results[f"world_size_error/{rank}"] = str(err)
        _killed(rank, cases[0]["kill"], results)
    except BaseException:
        results[f"error/{rank}"] = traceback.format_exc()
        raise
    finally:
        with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(results, f)
    os._exit(0)  # the group is broken (a rank was killed): do not wait for it on the way out


def _killed(rank: int, case: dict[str, Any], results: dict[str, Any]) -> None:
    """Run once, then rank ``victim`` kills itself; the others must raise RankFailedError naming it."""
    import torch.distributed as dist

    from placement.distributed import DistributedPipeline, RankFailedError

    pipe = DistributedPipeline(case["path"], heartbeat=0.1, grace=2.0)
    arrays = list(np.load(case["inputs"]).values()) if pipe.is_first else None
    pipe.run(arrays)
    dist.barrier()
    if rank == case["victim"]:
        with open(Path(case["outdir"]) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(results, f)
        os.kill(os.getpid(), signal.SIGKILL)
    message = "no error"
    start = time.monotonic()
    try:
        for _ in range(3):
            pipe.run(arrays)
        pipe.barrier()
    except RankFailedError as err:
        message = f"RankFailedError ranks={err.ranks}: {err}"
    except Exception as err:  # recorded for the test to show
        message = f"{type(err).__name__}: {err}"
    results[f"killed/{rank}"] = (time.monotonic() - start, message)
