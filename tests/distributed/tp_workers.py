"""What each spawned rank of the tensor-parallel tests runs (module level, so spawn can import it)."""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path
from typing import Any

import numpy as np


def cross_entropy(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _counting(results: dict[str, Any]) -> None:
    """Count the real ``torch.distributed`` collective calls of this process in ``results``."""
    import torch.distributed as dist

    for name in ("all_reduce", "all_gather"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            results[f"calls/{_name}"] = results.get(f"calls/{_name}", 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def gpt_ranks(rank: int, world_size: int, port: int, path: str, inputs: str, outdir: str) -> None:
    """Run, then train one step, a tensor-parallel gpt, then run it on ONNX Runtime ranks; rank 0
    also runs the emulated split (lowered, and with pl.Runner)."""
    import torch

    import placement as pl
    from placement.distributed import DistributedTensorParallel, DistributedTensorParallelRunner
    from tests.distributed.harness import init

    init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        data = np.load(inputs)
        idx, target = data["idx"], data["target"]
        with DistributedTensorParallel(path, loss_fn=cross_entropy) as tp:
            _counting(results)
            out = tp.run([idx] if tp.is_first else None)
            results["forward_calls"] = {k: v for k, v in results.items() if k.startswith("calls/")}
            results["issued_after_run"] = dict(tp.issued)
            results["collectives"] = [(s.kind, s.id, s.dangling) for s in tp.stage.collectives]
            if out is not None:
                model = pl.load(path)
                emulated = pl.to_torch(model, device_map={str(d): "cpu" for d in model.devices})
                with torch.no_grad():
                    results["emulated"] = emulated(torch.from_numpy(idx)).numpy()
                results["out"] = out[0]
            loss = tp.train_step([idx] if tp.is_first else None, target if tp.is_last else None)
            results["issued_after_step"] = dict(tp.issued)
            if loss is not None:
                results["loss"] = float(loss)
            results["grads"] = {name: p.grad.numpy().copy() for name, p in tp.named_parameters()}
            tp.barrier()
        with DistributedTensorParallelRunner(path, threads=1) as runner:  # the same on ONNX Runtime
            ort_out = runner.run([idx] if runner.is_first else None)
            results["ort_issued"] = runner.issued
            if ort_out is not None:
                model = pl.load(path)
                emulated_ort = pl.Runner(
                    model, device_map={str(d): "cpu" for d in model.devices}, fold=False, threads=1
                )
                results["ort_out"], results["ort_emulated"] = ort_out[0], emulated_ort.run([idx])[0]
    except BaseException:  # the test reads the traceback
        results["error"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def mse(out: Any, target: Any) -> Any:
    return ((out - target) ** 2).mean()


def mlp_three_ranks(rank: int, world_size: int, port: int, path: str, inputs: str, outdir: str) -> None:
    """A 3-way split mlp (ragged shards): ring and device-order all-reduces, and a training step."""
    import torch

    import placement as pl
    from placement.distributed import DistributedTensorParallel
    from tests.distributed.harness import init

    init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        data = np.load(inputs)
        x, target = data["x"], data["target"]
        for ordered in (False, True):
            with DistributedTensorParallel(path, loss_fn=mse, ordered=ordered) as tp:
                out = tp.run([x] if tp.is_first else None)
                if out is not None:
                    results[f"out/{ordered}"] = out[0]
                if ordered:
                    tp.train_step([x] if tp.is_first else None, target if tp.is_last else None)
                    results["grads"] = {name: p.grad.numpy().copy() for name, p in tp.named_parameters()}
        if rank == 0:
            model = pl.load(path)
            emulated = pl.to_torch(model, device_map={str(d): "cpu" for d in model.devices})
            with torch.no_grad():
                results["emulated"] = emulated(torch.from_numpy(x)).numpy()
    except BaseException:  # the test reads the traceback
        results["error"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def gpt_on_one_gpu(rank: int, world_size: int, port: int, path: str, inputs: str, outdir: str) -> None:
    """2 gloo ranks computing on cuda:0 (partials staged through host memory); rank 0 also
    runs the emulated split on the GPU. TF32 off."""
    import torch

    import placement as pl
    from placement.distributed import DistributedTensorParallel
    from tests.distributed.harness import init

    init(rank, world_size, port)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    results: dict[str, Any] = {}
    try:
        idx = np.load(inputs)["idx"]
        with DistributedTensorParallel(path, device="cuda:0") as tp:
            out = tp.run([idx] if tp.is_first else None)
            if out is not None:
                model = pl.load(path)
                emulated = pl.to_torch(model, device_map={str(d): "cuda:0" for d in model.devices})
                with torch.no_grad():
                    results["emulated"] = emulated(torch.from_numpy(idx)).detach().cpu().numpy()
                results["out"] = out[0]
            tp.barrier()
    except BaseException:  # the test reads the traceback
        results["error"] = traceback.format_exc()
    Path(outdir, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
