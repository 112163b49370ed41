"""What each spawned rank runs in the ONNX Runtime rank tests (module level, so spawn can import it)."""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np


def serve(rank: int, world_size: int, port: int, cases: list[dict[str, Any]], outdir: str) -> None:
    """Run every case on 2 ranks, then a world-size error, then rank 1 is killed."""
    from placement.distributed import DistributedRunner, RankFailedError, WorldSizeError
    from tests.distributed.harness import init

    init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        for case in cases:
            with DistributedRunner(case["path"], ranks=case.get("ranks")) as runner:
                inputs = list(np.load(case["inputs"]).values()) if runner.is_first else None
                out = runner.run(inputs, chunks=case.get("chunks"))
                if out is not None:
                    results[f"{case['key']}/out"] = out
        try:
            DistributedRunner(cases[0]["three"])
        except WorldSizeError as err:
            results[f"world_size_error/{rank}"] = str(err)
        runner = DistributedRunner(cases[0]["path"], heartbeat=0.1, grace=2.0)
        arrays = list(np.load(cases[0]["inputs"]).values()) if runner.is_first else None
        runner.run(arrays)
        runner.barrier()
        if rank == 1:
            with open(Path(outdir) / f"ort_rank{rank}.pkl", "wb") as f:
                pickle.dump(results, f)
            os.kill(os.getpid(), signal.SIGKILL)
        start, message = time.monotonic(), "no error"
        try:
            for _ in range(3):
                runner.run(arrays)
            runner.barrier()
        except RankFailedError as err:
            message = f"RankFailedError ranks={err.ranks}: {err}"
        except Exception as err:  # recorded for the test to show
            message = f"{type(err).__name__}: {err}"
        results[f"killed/{rank}"] = (time.monotonic() - start, message)
    except BaseException:
        results[f"error/{rank}"] = traceback.format_exc()
        raise
    finally:
        with open(Path(outdir) / f"ort_rank{rank}.pkl", "wb") as f:
            pickle.dump(results, f)
    os._exit(0)  # the group is broken (a rank was killed): do not wait for it on the way out
