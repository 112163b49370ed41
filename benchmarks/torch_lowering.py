"""Benchmark: latency of ``pl.to_torch`` modules relative to the original eager module.

For each model, the bench-size network is imported, split across ``devices``
logical devices Caffe2 style (activations shifted in equal slices,
``inject_cross_device_copies``), lowered with ``pl.to_torch`` and timed against
the original eager ``torch.nn.Module`` on the same inputs, in inference mode.
Runs alternate between the two so that drift (turbo, other load) hits both; the
reported latencies are medians and the reported ratio is the median of the
lowered / eager ratios of adjacent run pairs. Target: lowered / eager <= 1.10.

Without GPUs the logical devices are emulated on the CPU (the device map says
so), which measures the lowering's own overhead: op-by-op dispatch, copies as
``.to`` no-ops, folded shape arithmetic.

Usage::

    python benchmarks/torch_lowering.py                 # gpt and resnet, 2 devices
    python benchmarks/torch_lowering.py --models gpt mlp resnet unet --devices 2 4
    python benchmarks/torch_lowering.py --threads 0 1    # torch's default threads, then 1

Writes ``benchmarks/results/torch_lowering.json``. Another script can call
:func:`measure` directly.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, write_results  # noqa: E402
from placement import models  # noqa: E402
from placement.runtime.torch import to_torch  # noqa: E402

__all__ = ["measure", "main"]

log = logging.getLogger("benchmarks.torch_lowering")

RESULTS = RESULTS_DIR / "torch_lowering.json"
TARGET_RATIO = 1.10


def measure(
    model_name: str,
    size: str = "bench",
    devices: int = 2,
    repeats: int = 30,
    *,
    warmup: int = 5,
    device_map: Any = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """Time the lowered module against the eager original.

    Args:
        model_name: a name from ``models.MODELS``.
        size: ``"tiny"`` or ``"bench"``.
        devices: number of logical devices the model is split across.
        repeats: timed runs of each module (alternating).
        warmup: untimed runs of each first.
        device_map: passed to ``pl.to_torch``; the eager module runs on the
            physical device of logical ``cuda:0``.
        seed: model and input seed.

    Returns:
        A dict with ``model``, ``size``, ``devices``, ``ops``, ``copies``,
        ``device_map``, ``eager_ms`` / ``lowered_ms`` (medians), ``ratio`` (the
        median over alternating run pairs of lowered / eager), ``ratio_of_medians``,
        ``ratio_of_minima``, ``max_abs_diff`` and ``repeats``.

    Example:
        >>> row = measure("mlp", "tiny", devices=2, repeats=3, warmup=1)
        >>> sorted(row)[:3], row["max_abs_diff"] < 1e-4
        (['copies', 'device_map', 'devices'], True)
    """
    net, args = models.build(model_name, size, seed=seed)
    model = pl.place_evenly(pl.from_torch(net, args), devices)
    module = to_torch(model, device_map=device_map)
    first = module.device_map[str(min(model.devices))]
    net = net.to(first).eval()
    module.eval()
    eager_args = tuple(a.to(first) for a in args)
    lowered_args = tuple(a.to(first) for a in args)
    uses_cuda = any(v.startswith("cuda") for v in module.device_map.values())
    sync = torch.cuda.synchronize if uses_cuda else (lambda: None)
    with torch.inference_mode():
        expected = net(*eager_args)
        got = module(*lowered_args)
        diff = float((expected - got.to(expected.device)).abs().max())
        fns = {"eager": lambda: net(*eager_args), "lowered": lambda: module(*lowered_args)}
        times = alternate(fns, repeats, warmup=warmup, sync=sync).wall
        eager, lowered = times["eager"], times["lowered"]
    eager_ms = statistics.median(eager) * 1e3
    lowered_ms = statistics.median(lowered) * 1e3
    # adjacent runs share the machine's state, so the median of their ratios resists drift
    paired = statistics.median(lo / ea for lo, ea in zip(lowered, eager))
    return {
        "model": model_name,
        "size": size,
        "devices": devices,
        "ops": len(model.ops),
        "copies": sum(op.is_copy for op in model.ops),
        "device_map": module.device_map,
        "eager_ms": round(eager_ms, 4),
        "lowered_ms": round(lowered_ms, 4),
        "ratio": round(paired, 4),
        "ratio_of_medians": round(lowered_ms / eager_ms, 4),
        "ratio_of_minima": round(min(lowered) / min(eager), 4),
        "max_abs_diff": diff,
        "repeats": repeats,
    }


def _table(rows: Sequence[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"pl.to_torch latency vs eager torch (target ratio <= {TARGET_RATIO:.2f})")
    for column in (
        "model",
        "size",
        "devices",
        "threads",
        "ops",
        "copies",
        "physical",
        "eager ms",
        "lowered ms",
        "ratio",
        "min ratio",
        "max |diff|",
    ):
        table.add_column(column, justify="left" if column in ("model", "size", "physical") else "right")
    for row in rows:
        ok = row["ratio"] <= TARGET_RATIO
        table.add_row(
            row["model"],
            row["size"],
            str(row["devices"]),
            str(row.get("threads", torch.get_num_threads())),
            str(row["ops"]),
            str(row["copies"]),
            ",".join(sorted(set(row["device_map"].values()))),
            f"{row['eager_ms']:.3f}",
            f"{row['lowered_ms']:.3f}",
            f"[{'green' if ok else 'red'}]{row['ratio']:.3f}[/]",
            f"{row['ratio_of_minima']:.3f}",
            f"{row['max_abs_diff']:.1e}",
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print a table and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    parser.add_argument("--size", default="bench", choices=list(models.SIZES))
    parser.add_argument("--devices", nargs="+", type=int, default=[2])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device-map", default="auto", help="'auto', 'cpu' or 'cuda:0'")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[0], help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    rows = []
    default_threads = torch.get_num_threads()
    for threads in ns.threads:
        torch.set_num_threads(threads or default_threads)
        for name in ns.models:
            for n in ns.devices:
                row = measure(name, ns.size, n, ns.repeats, device_map=ns.device_map)
                rows.append({**row, "threads": torch.get_num_threads()})
    torch.set_num_threads(default_threads)
    env = environment(torch_threads=[row["threads"] for row in rows])
    print_tables(_table(rows), env=env)
    payload = {"benchmark": "torch_lowering", "target_ratio": TARGET_RATIO, "environment": env}
    write_results(ns.output, {**payload, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
