"""Planner benchmark: ``pl.auto_place`` against torchgpipe's and accelerate's planners.

Run: ``python benchmarks/planners.py`` (``--help`` for options). The peers are not
dependencies of ``placement``; install them into the environment for this script only::

    pip install torchgpipe accelerate

A peer that does not import is reported as missing and left out of the table.

Method (the same models, device counts, measurements and scoring for every planner):

1. Each ``models/`` zoo model (``bench`` size) is exported with ``pl.from_torch`` and
   profiled once: per-op forward times from ONNX Runtime's profiler
   (``pl.profile``, median of ``--repeats`` runs, one thread). These per-op times are the
   one cost model every plan is scored with.
2. Planners:

   * **ours**: ``pl.auto_place(model, devices=N, max_memory=..., cost="time", runtime="torch")``
     (op-by-op times, the cost model every plan is scored with), the exact
     bottleneck-optimal contiguous partition of the op order under the budgets.
   * **torchgpipe**: ``torchgpipe.balance.balance_cost``, the partition step of
     ``torchgpipe_balancing.balance_by_time``. ``balance_by_time`` itself needs an
     ``nn.Sequential`` and times each layer with torch; our models are not sequential,
     so its layers are the models' top-level modules in forward order (the units of
     ``pl.module_devices``: ``blocks.0``, ``blocks.1``, ... for numbered containers) and
     each layer's time is the sum of the measured times of its ops (unscoped ops count
     with the module before them). The resulting balance list is applied with
     ``pl.balance(model, balance, by="module")``. torchgpipe has no memory budgets.
   * **accelerate**: ``accelerate.infer_auto_device_map`` on the real ``nn.Module``, with
     ``no_split_module_classes`` set to the classes of those same top-level units. Without
     budgets it gets accelerate's "balanced" memory map (``get_balanced_memory``, what
     ``device_map="balanced"`` uses); with budgets, ``max_memory`` = the budgets. Its
     module -> device map is applied with ``pl.assign_modules`` (``cpu``/``disk``
     overflow becomes an extra ``cpu`` device, which breaks the budget by definition).

3. Every placement is scored by ``evaluate_assignment`` with the same per-op times and
   the same memory model: bottleneck = the largest per-device sum of op times;
   lower bound = max(total / N, largest op), which no placement can beat; bytes copied
   per step = one copy per (blob, reading device); memory per device = parameters read
   there (a parameter read on several devices counts on each) + liveness-based peak
   activations. "fits" says whether every device stays within the budget.

4. **with links**: the same placements scored under a link model (``--links``, default
   ``pcie``: 20 GB/s + 10 us per copy between GPUs; ``measured`` times this machine's
   copies with ``pl.measure_links``) plus the measured cost of cuts inside fusable
   patterns (``placement.planning.fusion``): a device's cost is its op times plus the
   time to copy its inputs in plus its cut costs, the bottleneck is the largest. Our
   entry in this column is ``pl.auto_place(..., links=...)`` (fusion-aware), the others'
   placements are the same as in the compute-only column.

Two scenarios per model and device count: no budget, and a uniform per-device budget
of max(1.15 x whole-model memory / N, 1.05 x the smallest uniform budget any
contiguous placement fits in).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import placement as pl  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import environment, environment_line, write_results  # noqa: E402
from placement import models  # noqa: E402
from placement.graph.nodes import is_copy_node, node_device  # noqa: E402
from placement.graph.sizes import format_bytes
from placement.planning.balance import _unit_costs  # noqa: E402
from placement.planning.fusion import fusion_cut_costs  # noqa: E402
from placement.planning.graph_info import GraphInfo  # noqa: E402
from placement.planning.link_model import resolve_links  # noqa: E402
from placement.planning.modules import module_units  # noqa: E402
from placement.planning.partition import PartitionProblem
from placement.planning.plan import Plan
from placement.planning.planner import evaluate_assignment

log = logging.getLogger("benchmarks.planners")

RESULTS = RESULTS_DIR / "planners.json"
INSTALL_HINT = "pip install torchgpipe accelerate   # benchmark-only peers, not placement dependencies"


def _peers() -> dict[str, Any]:
    found: dict[str, Any] = {}
    try:
        import torchgpipe
        from torchgpipe.balance import balance_cost

        found["torchgpipe"] = (torchgpipe.__version__, balance_cost)
    except Exception as err:  # noqa: BLE001 - any import failure means "missing"
        log.warning("torchgpipe unavailable (%s); %s", err, INSTALL_HINT)
    try:
        import accelerate
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        logging.getLogger("accelerate").setLevel(logging.ERROR)
        found["accelerate"] = (accelerate.__version__, infer_auto_device_map, get_balanced_memory)
    except Exception as err:  # noqa: BLE001
        log.warning("accelerate unavailable (%s); %s", err, INSTALL_HINT)
    return found


def _score(
    model: pl.Model,
    info: GraphInfo,
    costs: list[int],
    n: int,
    budget: int | None,
    links: Any = None,
    cuts: Any = None,
) -> Plan:
    """Score the model's current placement with the shared cost and memory model."""
    devices = [pl.Device("cuda", k) for k in range(n)]
    extra = sorted({node_device(node) for node in info.nodes} - set(devices))
    devices += extra  # overflow devices (accelerate's cpu/disk)
    index = {d: k for k, d in enumerate(devices)}
    part = [index[node_device(node)] for node in info.nodes]
    budgets = [budget] * n + [0] * len(extra)
    plan = evaluate_assignment(
        info,
        costs,
        part,
        devices,
        budgets,
        cost_kind="time",
        objective="throughput",
        links=links,
        cut_costs=cuts,
    )
    total = sum(costs)
    plan.lower_bound = max(max(costs), math.ceil(total / n))  # lower bound for N devices
    return plan


def _reset(model: pl.Model) -> None:
    for node in model.graph:
        if not is_copy_node(node):
            model.set_device(node.name, 0)


def _accelerate_map(net: Any, units: list[str], n: int, budget: int | None, peer: Any) -> dict[str, Any]:
    _, infer_auto_device_map, get_balanced_memory = peer
    classes = sorted({type(net.get_submodule(u)).__name__ for u in units})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if budget is None:
            max_memory = get_balanced_memory(
                net, max_memory={k: 10**12 for k in range(n)}, no_split_module_classes=classes
            )
        else:
            max_memory = {k: budget for k in range(n)}
        return dict(infer_auto_device_map(net, max_memory=max_memory, no_split_module_classes=classes))


def _apply_accelerate(model: pl.Model, device_map: dict[str, Any]) -> None:
    _reset(model)
    mapping: dict[str, pl.Device] = {}
    for module, device in device_map.items():
        mapping[module] = pl.Device("cuda", device) if isinstance(device, int) else pl.Device("cpu")
    if "" in mapping:  # the whole model on one device
        for node in model.graph:
            model.set_device(node.name, mapping.pop(""))
            break
        whole = next(iter(mapping.values()), None)
        for node in model.graph:
            model.set_device(node.name, whole or pl.Device("cuda", 0))
        return
    scopes = {op.scope for op in model.ops if op.scope}
    usable = {m: d for m, d in mapping.items() if any(s == m or s.startswith(m + ".") for s in scopes)}
    pl.assign_modules(model, usable)


def _row(
    model_name: str,
    n: int,
    scenario: str,
    method: str,
    plan: Plan,
    budget: int | None,
    seconds: float,
    linked: Plan,
) -> dict[str, Any]:
    used = sum(1 for d in plan.devices if d.ops)
    peak = max(d.memory for d in plan.devices)
    fits = (
        all(d.memory <= budget for d in plan.devices) and all(not d.ops for d in plan.devices[n:])
        if budget is not None
        else None
    )
    return {
        "model": model_name,
        "devices": n,
        "scenario": scenario,
        "method": method,
        "bottleneck_ms": plan.bottleneck / 1e6,
        "lower_bound_ms": plan.lower_bound / 1e6,
        "ratio": plan.bottleneck / plan.lower_bound if plan.lower_bound else 1.0,
        "transfer_bytes": plan.transfer_bytes,
        "peak_device_memory": peak,
        "budget": budget,
        "fits": fits,
        "devices_used": used,
        "planning_s": seconds,
        "with_links_ms": linked.bottleneck / 1e6,
        "with_links_ratio": linked.bottleneck / plan.lower_bound if plan.lower_bound else 1.0,
        "with_links_devices_used": sum(1 for d in linked.devices if d.ops),
    }


def run(
    names: list[str], device_counts: list[int], size: str, repeats: int, links_spec: str = "pcie"
) -> dict[str, Any]:
    peers = _peers()
    links: Any = links_spec
    rows: list[dict[str, Any]] = []
    for name in names:
        net, args = models.build(name, size)
        model = pl.from_torch(net, args)
        prof = pl.profile(model, sample_inputs=args, repeats=repeats)
        costs = prof.costs("time")
        info = GraphInfo(model)
        whole = info.segment_memory(0, len(info))
        units = list(module_units(model))
        cuts = fusion_cut_costs(model, info, repeats=repeats)
        log.info(
            "%s: %d ops, %.2f ms per forward, %d top-level units",
            name,
            len(info),
            prof.total_time_s * 1e3,
            len(units),
        )
        for n in device_counts:
            if links_spec == "measured":
                links = pl.measure_links([pl.Device("cuda", k) for k in range(n)])
            link_model = resolve_links(links)
            smallest = PartitionProblem(costs, [whole] * n, info).min_uniform_budget()
            budget = max(math.ceil(1.15 * whole / n), math.ceil(1.05 * smallest))
            for scenario, b in (("no budget", None), (f"budget {format_bytes(budget)}", budget)):
                start = time.perf_counter()
                max_memory = {k: b for k in range(n)} if b is not None else None
                pl.auto_place(
                    model,
                    devices=n,
                    max_memory=max_memory,
                    cost="time",
                    links=None,
                    fusion=False,
                    runtime="torch",
                )
                elapsed = time.perf_counter() - start
                plain = _score(model, info, costs, n, b)
                _reset(model)
                pl.auto_place(
                    model, devices=n, max_memory=max_memory, cost="time", links=link_model, runtime="torch"
                )
                linked = _score(model, info, costs, n, b, link_model, cuts)
                rows.append(_row(name, n, scenario, "ours", plain, b, elapsed, linked))
                if "torchgpipe" in peers:
                    balance_cost = peers["torchgpipe"][1]
                    start = time.perf_counter()
                    unit_costs = _unit_costs(model, costs, "module")
                    balance = balance_cost(unit_costs, n)
                    elapsed = time.perf_counter() - start
                    _reset(model)
                    pl.balance(model, balance, by="module")
                    rows.append(
                        _row(
                            name,
                            n,
                            scenario,
                            "torchgpipe",
                            _score(model, info, costs, n, b),
                            b,
                            elapsed,
                            _score(model, info, costs, n, b, link_model, cuts),
                        )
                    )
                if "accelerate" in peers:
                    start = time.perf_counter()
                    device_map = _accelerate_map(net, units, n, b, peers["accelerate"])
                    elapsed = time.perf_counter() - start
                    _apply_accelerate(model, device_map)
                    rows.append(
                        _row(
                            name,
                            n,
                            scenario,
                            "accelerate",
                            _score(model, info, costs, n, b),
                            b,
                            elapsed,
                            _score(model, info, costs, n, b, link_model, cuts),
                        )
                    )
    return {
        "size": size,
        "repeats": repeats,
        "peers": {k: v[0] for k, v in peers.items()},
        "placement": pl.__version__,
        "links": links_spec,
        "rows": rows,
    }


def _table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=f"planners on the models/ zoo ({result['size']} size), per-op ORT times")
    for col in (
        "model",
        "N",
        "scenario",
        "method",
        "bottleneck",
        "x lower bound",
        f"with links ({result.get('links', 'pcie')})",
        "copied/step",
        "peak mem",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("model", "scenario", "method") else "right")
    for r in result["rows"]:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "NO")
        table.add_row(
            r["model"],
            str(r["devices"]),
            r["scenario"],
            r["method"],
            f"{r['bottleneck_ms']:.3f} ms",
            f"{r['ratio']:.3f}",
            f"{r['with_links_ms']:.3f} ms",
            format_bytes(r["transfer_bytes"]),
            format_bytes(r["peak_device_memory"]),
            fits,
        )
    return table


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown table (for the README)."""
    lines = [
        "| model | N | budget | planner | bottleneck | x lower bound | with links | copied / step "
        "| peak memory | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "**no**")
        name = f"**{r['method']}**" if r["method"] == "ours" else r["method"]
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['scenario'].replace('budget ', '')} | {name} | "
            f"{r['bottleneck_ms']:.2f} ms | {r['ratio']:.3f} | {r['with_links_ms']:.2f} ms | "
            f"{format_bytes(r['transfer_bytes'])} | "
            f"{format_bytes(r['peak_device_memory'])} | {fits} |"
        )
    return "\n".join(lines)


def _verdicts(result: dict[str, Any]) -> list[str]:
    lines = []
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in result["rows"]:
        groups.setdefault((r["model"], r["devices"], r["scenario"]), {})[r["method"]] = r
    for (model, n, scenario), methods in groups.items():
        ours = methods["ours"]
        # a placement that breaks the budget is no competitor
        peers = [m for k, m in methods.items() if k != "ours" and m["fits"] is not False]
        not_worse = all(ours["bottleneck_ms"] <= p["bottleneck_ms"] + 1e-12 for p in peers)
        linked = all(ours["with_links_ms"] <= p["with_links_ms"] + 1e-12 for p in peers)
        lines.append(
            f"{model} N={n} {scenario}: ours {ours['ratio']:.3f} x lower bound; "
            f"{'never worse than' if not_worse else 'WORSE than'} the peers; with links "
            f"{'never worse than' if linked else 'WORSE than'} the peers"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(models.MODELS), choices=list(models.MODELS))
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--size", default="bench", choices=list(models.SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--links",
        default="pcie",
        help="link model for the 'with links' column: a preset (pcie, nvlink, host, memcpy) or 'measured'",
    )
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(options.models, options.devices, options.size, options.repeats, options.links)
    from rich.console import Console

    result["environment"] = env = environment()
    console = Console(width=140)
    console.print(environment_line(env), highlight=False)
    console.print(_table(result))
    for line in _verdicts(result):
        console.print(line)
    if options.markdown:
        print(markdown(result))
    if not result["peers"]:
        console.print(f"no peers installed: {INSTALL_HINT}")
    write_results(options.out, result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
