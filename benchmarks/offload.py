"""Benchmark: one GPU and a model that does not fit, placement's offload plan against accelerate's.

The model is GPT-2-shaped (``models/gpt.py``): ``--size large`` (the default) is 24 layers,
d=2048, 16 heads, vocabulary 8192, fp16 (1.23B parameters, 2.28 GiB);
``--size tiny`` is a smoke size for CPU machines. It is exported once with a
dynamic batch and saved as ONNX with external data. With the same GPU budget
(``--gpu-budget``, default 1 GiB):

* **placement**: ``pl.plan_offload(model, {0: budget, "cpu": ...})`` with the
  host->GPU link measured here (pinned copies) and the GPU's FLOP rate measured from
  the all-on-GPU run; the plan is lowered to torch (``pl.to_torch``): resident
  layers on the GPU, streamed weights in pinned host memory copied on a side stream
  and prefetched, host layers on the CPU;
* **accelerate**: ``infer_auto_device_map(max_memory={0: budget, "cpu": ...},
  no_split_module_classes=["Block"])`` + ``dispatch_model`` (its hooks copy each
  offloaded layer's weights synchronously before it runs); skipped with a message
  when accelerate is not installed;
* **all on the GPU** (the eager module, no budget): the compute-bound reference.

Reported per batch (throughput at 8 x 512, latency at 1 x 512): median time of
``--repeats`` forwards; the transfer-bound limit (bytes streamed per forward /
measured pinned bandwidth, against the all-on-GPU compute: the larger of the two);
placement's transfer overlap (the fraction of its copy time, timed with CUDA events
on the copy stream, hidden behind compute: ``1 - (t - t_all_gpu) / t_copy``,
clipped to [0, 1]); peak GPU memory (``torch.cuda.max_memory_allocated``, and the reserved
peak ``max_memory_reserved``: what the process holds, which the budget limits) beside the
plan's estimate (resident weights, window, activations at 8 x 512, workspace measured
once); the largest difference from the all-on-GPU outputs (fp16 on both sides; TF32
off) and from the fp32 model's (the truth both fp16 runs round away from: host layers
compute in fp32, so placement may differ from all-on-GPU fp16 by more than it differs
from fp32). The run fails (exit 1, after writing its JSON) when the reserved peak exceeds the
budget.

On a machine without CUDA only ``--size tiny`` runs: the placement path (plan,
streamed weights, lowering, CPU emulation of ``cuda:0``) is exercised with the copies
on the emulated copy engine (late, out of order, poisoned until done) and checked
bit for bit against the same module without streaming, and against the eager outputs;
the GPU-only columns say why they are empty.

Usage::

    python benchmarks/offload.py                                 # on a GPU: the 1.23B model
    python benchmarks/offload.py --gpu-budget 1GiB --repeats 10
    python benchmarks/offload.py --size tiny --out /tmp/o.json   # a smoke run (CPU)

Writes ``benchmarks/results/offload.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import placement as pl  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment, print_tables, write_results  # noqa: E402
from placement.graph.sizes import format_bytes, parse_bytes  # noqa: E402
from placement.models.gpt import GPT, GPTConfig  # noqa: E402

RESULTS = RESULTS_DIR / "offload.json"
#: size -> (config, sequence length, batches (throughput, latency), dtype)
SIZES: dict[str, tuple[GPTConfig, int, tuple[int, int], torch.dtype]] = {
    "large": (
        GPTConfig(vocab_size=8192, block_size=512, n_layer=24, n_head=16, d_model=2048),
        512,
        (8, 1),
        torch.float16,
    ),
    "tiny": (
        GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, d_model=32),
        16,
        (4, 1),
        torch.float32,
    ),
}
NO_GPU = "no CUDA GPU here: accelerate, peak GPU memory, overlap and the limit need one"


def _median_time(fn: Any, repeats: int, *, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    timings = alternate({"fn": fn}, repeats, warmup=1, sync=torch.cuda.synchronize if cuda else None)
    return timings.medians()["fn"]


def pinned_bandwidth(nbytes: int = 256 << 20) -> dict[str, float]:
    """Host->GPU bytes/s of a pinned and a pageable copy, timed with CUDA events."""
    result = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8)
        if kind == "pinned":
            host = host.pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        result[kind] = nbytes / statistics.median(times)
        del host, dev
    return result


def build(size: str, folder: Path) -> tuple[torch.nn.Module, Path, GPTConfig, int]:
    """The model (eval, on the host, in its dtype) and its placed-graph source saved with external data."""
    config, seq, _, dtype = SIZES[size]
    torch.manual_seed(0)
    net = GPT(config).eval().to(dtype)
    idx = torch.randint(0, config.vocab_size, (2, seq))
    model = pl.from_torch(net, (idx,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    path = folder / "gpt.onnx"
    model.save(path, external_data=True)
    return net, path, config, seq


def _flops(net: torch.nn.Module, batch: int, seq: int) -> float:
    """Forward FLOPs of the GPT, 2 per multiply-add of its matrices (attention scores included)."""
    params = sum(p.numel() for p in net.parameters())
    config = net.config
    return 2.0 * batch * seq * params + 4.0 * batch * config.n_layer * seq * seq * config.d_model


def _max_diff(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float().cpu() - reference).abs().max())


def _all_on_gpu(net: torch.nn.Module, inputs: dict[int, torch.Tensor], gpu: str, args: Any) -> dict[str, Any]:
    """The eager module on the device: reference outputs (in its dtype, and in fp32), times, peak."""
    cuda = gpu != "cpu"
    reference, reference32, times = {}, {}, {}
    net_gpu = net.to(gpu)
    with torch.no_grad():
        for b, idx in inputs.items():
            x = idx.to(gpu)
            reference[b] = net_gpu(x).float().cpu()
            times[b] = _median_time(functools.partial(net_gpu, x), args.repeats, cuda=cuda)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        dtype = next(net_gpu.parameters()).dtype
        if dtype != torch.float32:  # the fp32 model: the truth both fp16 runs are measured against
            net_gpu.float()
            reference32 = {b: net_gpu(idx.to(gpu)).float().cpu() for b, idx in inputs.items()}
            net_gpu.to(dtype)
    net_gpu.cpu()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"reference": reference, "reference32": reference32, "time_s": times, "peak": peak}


def _plan(path: Path, net: torch.nn.Module, inputs: dict[int, torch.Tensor], args: Any, ref: dict) -> Any:
    """The offload plan for the throughput batch, with the link and workspace measured on a GPU."""
    from placement.runtime.torch.streaming import measure_workspace

    cuda = torch.cuda.is_available()
    _, seq, batches, _ = SIZES[args.size]
    big = batches[0]
    bandwidth = pinned_bandwidth() if cuda else None
    link = pl.Link(bandwidth["pinned"]) if bandwidth else pl.Link(20e9)
    # the GPU's FLOP rate from the all-on-GPU run; emulated on the CPU: a GPU 100x the host
    gpu_rate = _flops(net, big, seq) / ref["time_s"][big] if cuda else 100 * args.host_flops
    model = pl.load(path)
    plan = pl.plan_offload(
        model,
        {0: args.budget, "cpu": parse_bytes(args.host_budget)},
        cost="flops",
        links=link,
        throughput={"cuda": gpu_rate, "cpu": args.host_flops},
        sample_inputs={"idx": inputs[big].numpy()},
        workspace=measure_workspace("cuda:0") if cuda else None,
    )
    print(plan, flush=True)
    pl.inject_cross_device_copies(model, output_device=0)
    pl.verify(model)
    return model, plan, bandwidth


def _placement(
    model: Any, plan: Any, inputs: dict[int, torch.Tensor], args: Any, ref: dict
) -> dict[str, Any]:
    """The plan lowered to torch: outputs (against all-on-device, fp32, and unstreamed), times,
    overlap, peak memory against the budget. On the CPU the copies run on the emulated engine."""
    from placement.runtime.torch.copy_emulation import EmulatedCopyEngine

    cuda = torch.cuda.is_available()
    gpu = "cuda:0" if cuda else "cpu"
    streamed_bytes = sum(model.parameters[name].nbytes for name in model.streamed)
    module = pl.to_torch(model, device_map={"cuda:0": gpu, "cpu": "cpu"})
    streamer = getattr(module, "weight_streamer", None)
    unstreamed: dict[int, torch.Tensor] = {}
    engine = None
    if not cuda and streamer is not None:  # the same schedule with late, out-of-order, poisoned copies
        with torch.no_grad():
            unstreamed = {b: module(idx) for b, idx in inputs.items()}
        engine = streamer.use(EmulatedCopyEngine(latency=0.0005))
    times, diffs, diffs32, same, overlap = {}, {}, {}, {}, {}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the reserved peak counts this run's segments only
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for b, idx in inputs.items():
            x = idx.to(gpu)
            out = module(x)
            diffs[b] = _max_diff(out, ref["reference"][b])
            if b in ref["reference32"]:
                diffs32[b] = _max_diff(out, ref["reference32"][b])
            if b in unstreamed:
                same[b] = bool(torch.equal(out, unstreamed[b]))
            times[b] = _median_time(functools.partial(module, x), args.repeats, cuda=cuda)
            overlap[b] = (
                _overlap(module, streamer, x, times[b], ref["time_s"][b]) if cuda and streamed_bytes else None
            )
    peak = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    if engine is not None:
        engine.close()
    row = {
        "time_s": times,
        "peak_gpu_bytes": peak,
        "peak_gpu_reserved_bytes": reserved,
        "plan_gpu_bytes": plan.gpu_bytes,
        "budget_held": None if reserved is None else reserved <= args.budget,
        "max_abs_diff": max(diffs.values()),
        "logit_scale": max(float(ref["reference"][b].abs().max()) for b in inputs),
        "max_abs_diff_fp32": max(diffs32.values()) if diffs32 else None,
        "same_as_unstreamed": all(same.values()) if same else None,
        "overflow_copies": streamer.overflow if streamer is not None else 0,
        "overlap": overlap,
        "modes": {
            mode: sum(1 for m in plan.modes.values() if m == mode)
            for mode in ("resident", "streamed", "host")
        },
        "streamed_bytes": streamed_bytes,
        "window_bytes": plan.window,
        "window_depth": plan.depth,
        "activation_bytes": plan.activation_bytes,
        "workspace_bytes": plan.workspace_bytes,
        "predicted_s": plan.predicted_ns / 1e9,
    }
    del module
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _overlap(module: Any, streamer: Any, x: torch.Tensor, t: float, t_all: float) -> float:
    """The fraction of the copy time hidden behind compute: ``1 - (t - t_all_gpu) / t_copy``."""
    streamer.timing = True
    streamer.reset_stats()
    module(x)
    torch.cuda.synchronize()
    copy_s = streamer.copy_seconds()
    streamer.timing = False
    streamer.reset_stats()
    hidden = 1.0 - (t - t_all) / copy_s if copy_s > 0 else 1.0
    return min(1.0, max(0.0, hidden))


def _accelerate(net: torch.nn.Module, inputs: dict[int, torch.Tensor], args: Any, ref: dict) -> dict | str:
    """accelerate's dispatch under the same budget, or why it did not run."""
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return "accelerate: not installed (pip install accelerate); its row is skipped"
    max_memory = {0: args.budget, "cpu": parse_bytes(args.host_budget)}
    device_map = infer_auto_device_map(net, max_memory=max_memory, no_split_module_classes=["Block"])
    on_gpu = sum(1 for d in device_map.values() if d == 0)
    dispatched = dispatch_model(net, device_map)
    torch.cuda.reset_peak_memory_stats()
    times, diffs, diffs32 = {}, {}, {}
    with torch.no_grad():
        for b, idx in inputs.items():
            x = idx.to("cuda:0")
            out = dispatched(x)
            diffs[b] = _max_diff(out, ref["reference"][b])
            if b in ref["reference32"]:
                diffs32[b] = _max_diff(out, ref["reference32"][b])
            times[b] = _median_time(functools.partial(dispatched, x), args.repeats, cuda=True)
    return {
        "time_s": times,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "max_abs_diff": max(diffs.values()),
        "max_abs_diff_fp32": max(diffs32.values()) if diffs32 else None,
        "entries_on_gpu": f"{on_gpu} of {len(device_map)}",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    if not cuda and args.size != "tiny":
        raise SystemExit(f"--size {args.size} needs a CUDA GPU ({NO_GPU}); use --size tiny for a smoke run")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.budget = parse_bytes(args.gpu_budget)
    _, seq, batches, dtype = SIZES[args.size]
    work = Path(tempfile.mkdtemp(prefix="offload-bench-"))
    print(f"building and exporting the {args.size} model to {work} ...", flush=True)
    net, path, config, seq = build(args.size, work)
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if args.size == "tiny" and args.gpu_budget == parser_default("gpu_budget"):
        args.budget = int(weight_bytes * 0.6)  # the smoke size: 60% of its weights fit
    if not cuda:
        torch.set_num_threads(1)  # the smoke run: one thread, steady on a shared machine
    inputs = {b: torch.randint(0, config.vocab_size, (b, seq)) for b in batches}
    notes: list[str] = []
    ref = _all_on_gpu(net, inputs, "cuda:0" if cuda else "cpu", args)
    rows: dict[str, dict[str, Any]] = {
        "all on the GPU": {"time_s": ref["time_s"], "peak_gpu_bytes": ref["peak"], "max_abs_diff": 0.0}
    }
    if ref["reference32"]:
        rows["all on the GPU"]["max_abs_diff_fp32"] = max(
            _max_diff(ref["reference"][b], ref["reference32"][b]) for b in batches
        )
    model, plan, bandwidth = _plan(path, net, inputs, args, ref)
    rows["placement"] = _placement(model, plan, inputs, args, ref)
    streamed_bytes = rows["placement"]["streamed_bytes"]
    del model
    if not cuda:
        notes.append(f"accelerate: skipped ({NO_GPU})")
    else:
        acc = _accelerate(net, inputs, args, ref)
        if isinstance(acc, str):
            notes.append(acc)
        else:
            rows["accelerate"] = acc
    limit = {
        b: max(ref["time_s"][b], streamed_bytes / bandwidth["pinned"]) if bandwidth else None for b in batches
    }
    return {
        "environment": environment(
            device=torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or 'unknown'})"
        ),
        "size": args.size,
        "parameters": sum(p.numel() for p in net.parameters()),
        "weight_bytes": weight_bytes,
        "dtype": str(dtype).replace("torch.", ""),
        "gpu_budget_bytes": args.budget,
        "batches": {"throughput": f"{batches[0]} x {seq}", "latency": f"{batches[1]} x {seq}"},
        "bandwidth": bandwidth,
        "limit_s": limit,
        "rows": rows,
        "notes": notes,
    }


def parser_default(name: str) -> Any:
    return _parser().get_default(name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large", choices=sorted(SIZES), help="tiny: a CPU smoke run")
    parser.add_argument("--gpu-budget", default="1GiB", help="GPU memory budget, e.g. 1GiB")
    parser.add_argument("--host-budget", default="48GiB", help="host memory budget")
    parser.add_argument("--host-flops", type=float, default=0.5e12, help="host FLOP/s assumed by the planner")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    batches = list(next(iter(result["rows"].values()))["time_s"])
    title = (
        f"{result['environment']['device']}: GPT {result['parameters'] / 1e9:.2f}B {result['dtype']} "
        f"({format_bytes(result['weight_bytes'])}), GPU budget {format_bytes(result['gpu_budget_bytes'])}"
    )
    table = Table(title=title)
    for col in (
        "contender",
        *(f"batch {b} (ms)" for b in batches),
        "x accelerate",
        "overlap",
        "peak GPU",
        "plan's GPU",
        "max |diff|",
        "|diff| to fp32",
    ):
        table.add_column(col)
    acc = result["rows"].get("accelerate")
    for name, row in result["rows"].items():
        speedups = []
        if acc is not None and name != "accelerate":
            speedups = [f"{acc['time_s'][b] / row['time_s'][b]:.1f}" for b in batches]
        overlap = row.get("overlap") or {}
        table.add_row(
            name,
            *(f"{row['time_s'][b] * 1e3:.1f}" for b in batches),
            " / ".join(speedups) or "-",
            " / ".join(f"{overlap[b]:.0%}" for b in batches if overlap.get(b) is not None) or "-",
            format_bytes(row["peak_gpu_bytes"]) if row.get("peak_gpu_bytes") is not None else "-",
            format_bytes(row["plan_gpu_bytes"]) if row.get("plan_gpu_bytes") is not None else "-",
            f"{row['max_abs_diff']:.2e}",
            f"{row['max_abs_diff_fp32']:.2e}" if row.get("max_abs_diff_fp32") is not None else "-",
        )
    limit = result["limit_s"]
    if all(v is not None for v in limit.values()):
        table.add_row(
            "transfer-bound limit", *(f"{limit[b] * 1e3:.1f}" for b in batches), "-", "-", "-", "-", "-", "-"
        )
    print_tables(table, env=result["environment"], width=160)
    for note in result["notes"]:
        print(note)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = run(args)
    print_table(result)
    write_results(args.out, result)
    placed = result["rows"]["placement"]
    if placed["budget_held"] is False:
        peak = format_bytes(placed["peak_gpu_reserved_bytes"])
        planned, budget = format_bytes(placed["plan_gpu_bytes"]), format_bytes(result["gpu_budget_bytes"])
        print(f"FAILED: peak reserved GPU memory {peak} is over the budget {budget} (the plan: {planned})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
