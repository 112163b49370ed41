"""Benchmark: offload plans for one GPU plus the host, the mode search against the spread guess alone.

For GPT-2-shaped models (``models/gpt.py``, random weights) under a range of GPU budgets, every
plan is scored by the same simulation of one forward (``placement.planning.offload.simulate``:
GPU compute stream, copy stream, host layers with their activation copies) with the same
device speeds (``--gpu-flops``, ``--host-flops``; defaults: the stated defaults of
``placement.planning.speeds``) and host -> GPU link (PCIe, 20 GB/s):

* **search**: what ``pl.auto_place(max_memory={0: budget, "cpu": ...})`` plans at one window
  depth: the GPU holds the activations of the ops it runs; a local search over layer modes
  (single changes, swaps, ejections) starts from the spread guess, every layer on the host,
  repaired all-resident and all-streamed plans and a greedy fill by time per weight byte;
* **spread only**: the spread guess alone (``plan_offload``'s first candidates) with the
  whole model's activation peak counted on the GPU whatever runs there;
* **all host**: every layer computed on the host.

Columns: the search's own wall time (ms, this machine), and per contender the layers on the GPU
(resident + streamed), the predicted forward (ms), and its time as a multiple of the search's
(side by side, one run). "-" where a plan does not
fit the budget. Everything is predicted; on a GPU, ``benchmarks/offload.py`` times plans.

Usage::

    python benchmarks/offload_plans.py                 # the 6-layer d=1024 and 4-layer d=256 GPTs
    python benchmarks/offload_plans.py --models small  # the small one only (seconds)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import placement as pl  # noqa: E402
from benchmarks.harness import environment, print_tables, table  # noqa: E402
from placement.errors import InfeasiblePlacementError  # noqa: E402
from placement.graph.sizes import format_bytes, parse_bytes  # noqa: E402
from placement.models.gpt import GPT, GPTConfig  # noqa: E402
from placement.planning.graph_info import GraphInfo  # noqa: E402
from placement.planning.link_model import resolve_links  # noqa: E402
from placement.planning.offload import _choose, _memory, _memory_floor, layers_of, simulate  # noqa: E402
from placement.planning.offload_search import gpu_activations, search_modes  # noqa: E402
from placement.planning.speeds import DEFAULT_FLOPS  # noqa: E402

#: the window depth the contenders are compared at (streamed layers in the window)
DEPTH = 2

#: name -> (config, (batch, tokens), GPU budgets)
MODELS = {
    "big": (
        GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=16, d_model=1024),
        (8, 256),
        ["80MiB", "150MiB", "200MiB", "250MiB", "300MiB", "450MiB"],
    ),
    "small": (
        GPTConfig(vocab_size=8192, block_size=32, n_layer=4, n_head=4, d_model=256),
        (1, 32),
        ["4MiB", "5MiB", "8MiB", "12MiB", "20MiB", "40MiB"],
    ),
}


def _plans(
    model: pl.Model, budget: int, rates: dict[str, float]
) -> tuple[dict[str, tuple[list[str], int] | None], float]:
    """Each contender's plan (None: it does not fit) and the seconds the search took."""
    info = GraphInfo(model)
    flops = pl.profile(model, time=False).costs("flops")
    gpu_ns = [round(f / rates["cuda"] * 1e9) for f in flops]
    host_ns = [round(f / rates["cpu"] * 1e9) for f in flops]
    layers = layers_of(model, info, gpu_ns, host_ns)
    link = resolve_links("auto").link(pl.Device("cpu", 0), pl.Device("cuda", 0))
    budgets = (budget, None)
    acts = gpu_activations(info, layers)
    whole = info.segment_peak_activation(0, len(info))
    peaks = [info.segment_peak_activation(layer.start, layer.end) for layer in layers]

    def time_of(modes: list[str]) -> int:
        return simulate(layers, modes, link, link, depth=DEPTH)

    out: dict[str, tuple[list[str], int] | None] = {}
    start = time.perf_counter()
    try:
        out["search"] = search_modes(
            layers,
            budgets,
            lambda m: _memory(layers, m, acts, 0, DEPTH),
            time_of,
            heuristic=lambda: _choose(layers, budgets, acts, 0, link, link, depths=(DEPTH,))[:2],
            floor=_memory_floor(layers, peaks, 0, DEPTH),
        )
    except InfeasiblePlacementError:
        out["search"] = None
    seconds = time.perf_counter() - start
    try:
        modes = _choose(layers, budgets, whole, 0, link, link, depths=(DEPTH,))[0]
        out["spread only"] = (modes, time_of(modes))
    except InfeasiblePlacementError:
        out["spread only"] = None
    every = ["host"] * len(layers)
    out["all host"] = (every, time_of(every))
    return out, seconds


def run(names: list[str], rates: dict[str, float]) -> list[list[str]]:
    rows = []
    for name in names:
        config, shape, budgets = MODELS[name]
        torch.manual_seed(0)
        net = GPT(config).eval()
        start = time.perf_counter()
        model = pl.from_torch(net, (torch.randint(0, config.vocab_size, shape),))
        weights = sum(p.nbytes for p in model.parameters.values())
        print(
            f"{name}: {config.n_layer} layers, d={config.d_model}, {shape[0]} x {shape[1]} tokens, "
            f"{format_bytes(weights)} of weights (exported in {time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        for budget in budgets:
            plans, seconds = _plans(model, parse_bytes(budget), rates)
            best = plans["search"][1] if plans["search"] else None
            row = [name, budget, f"{seconds * 1e3:.0f}"]
            for key in ("search", "spread only", "all host"):
                plan = plans[key]
                if plan is None:
                    row += ["-", "-", "-"]
                    continue
                modes, ns = plan
                on_gpu = sum(m != "host" for m in modes)
                ratio = f"{ns / best:.2f}" if best else "-"
                row += [str(on_gpu), f"{ns / 1e6:.3f}", ratio]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--gpu-flops", type=float, default=DEFAULT_FLOPS["cuda"])
    parser.add_argument("--host-flops", type=float, default=DEFAULT_FLOPS["cpu"])
    options = parser.parse_args(argv)
    rates = {"cuda": options.gpu_flops, "cpu": options.host_flops}
    rows = run(options.models, rates)
    header = ["model", "GPU budget", "search: planning ms"]
    for key in ("search", "spread only", "all host"):
        header += [f"{key}: GPU layers", f"{key}: ms", f"{key}: x search"]
    speeds = f"cuda {rates['cuda']:.3g} FLOP/s, cpu {rates['cpu']:.3g} FLOP/s; link PCIe 20 GB/s"
    title = f"offload plans (speeds: {speeds})"
    print_tables(table(title, header, rows), env=environment(), width=200)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
