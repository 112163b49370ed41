"""Benchmark: what placement costs on a GPU, side by side in one process, and what N GPUs would give.

Two logical devices share one GPU (``device_map={0: "cuda:0", 1: "cuda:0"}``), so every
ratio is what placement itself costs there. Contenders alternate (blocks of runs, the
order flipping every round), each pair is built afresh ``--trials`` times and the
ratio is the median of the per-pair median ratios. Sections (``--sections``):

* ``ort``: ``pl.Runner`` (placed in halves) / one CUDA ``InferenceSession`` of the
  unplaced model, for bench gpt (batch 8), resnet, hf-gpt2 and the big GPT (12 layers,
  d=1024, 16 heads, vocabulary 8192, sequence 512, batch 8), with numpy I/O and with
  device-resident I/O (torch CUDA tensors in, ``outputs="torch"`` out, against the single
  session run through an IOBinding), each without and with another CUDA session of
  the same model alive in the process. Targets: <= 1.03 (big), <= 1.10 (bench models).
* ``call``: the fixed cost of one more stage call: bench gpt in 4 stages vs 2, per extra stage.
* ``pipeline``: ``Runner(chunks=4)`` / ``Runner(chunks=1)`` (ORT run) and ``pl.train_step``
  on ``to_torch(chunks=4)`` / on ``to_torch()`` (torch step), bench and big GPT, with the
  micro-batches run one after another on one session beside them (what smaller
  micro-batches cost the GPU itself). Target <= 1.15 on the big GPT.
* ``graphs``: ``to_torch(cuda_graphs=True)`` and plain ``to_torch`` / the eager module,
  tiny and bench gpt, under ``torch.no_grad()``. Targets: graphs <= 1.0, plain <= 1.05.
* ``memory``: the GPU memory a placed run holds / a single session's, each measured in a
  fresh process (``torch.cuda.mem_get_info`` before building and after three runs:
  ONNX Runtime's arenas keep what they grew to, so this is their peak). Target <= 1.15.
* ``predict``: the big GPT in 2, 4 and 8 logical stages on the one GPU (kept apart):
  predicted (stage times at the micro-batch size, the schedule's fixed cost measured
  first) against measured ``Runner(chunks=k)`` and ``pl.train_step``, and ``pl.predict``
  for 2, 4 and 8 GPUs on NVLink and PCIe (:mod:`benchmarks.gpu_predict`).
* ``validate-cpu`` (runs on any machine): bench gpt (batch 8) on two devices emulated on
  the CPU, one thread per stage: ``pl.predict`` from the stages' times measured at the
  micro-batch size against the measured ``Runner(chunks=k)``; the error per ``k``.

Without a CUDA GPU (torch's and ONNX Runtime's CUDA provider) only ``validate-cpu``
runs; every GPU section says so and is skipped. ``--dry-run`` runs ``validate-cpu`` and
``predict`` on the tiny gpt on the CPU (which stands in for the GPU) with a few repeats
(a smoke test); ``--dry-run --sections predict`` only the latter.

Usage::

    python benchmarks/gpu.py                        # everything (on a GPU machine)
    python benchmarks/gpu.py --sections ort graphs --trials 3
    python benchmarks/gpu.py --dry-run              # CPU smoke of the predictor validation

Writes ``benchmarks/results/gpu.json`` (the device name and versions included).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:  # the torch sections run without ONNX Runtime
    import onnxruntime as ort
except ImportError:  # pragma: no cover - an environment without it
    ort = None

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import placement as pl  # noqa: E402
from benchmarks.gpu_setup import StageTimer, big_gpt, export, model_and_inputs  # noqa: E402
from benchmarks.harness import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.harness import alternate, environment  # noqa: E402
from placement.graph.saving import to_proto  # noqa: E402

__all__ = ["main", "validate_cpu", "stage_times"]

log = logging.getLogger("benchmarks.gpu")

RESULTS = RESULTS_DIR / "gpu.json"
SECTIONS = ("ort", "call", "pipeline", "graphs", "memory", "predict", "validate-cpu")
SHARED = {0: "cuda:0", 1: "cuda:0"}
TARGETS = {
    "ort_big": 1.03,
    "ort_bench": 1.10,
    "pipeline": 1.15,
    "graphs": 1.0,
    "lowered": 1.05,
    "memory": 1.15,
}


#: what each GPU section needs: "torch" (a CUDA GPU torch sees) or "ort" (that, and ONNX
#: Runtime's CUDA provider really running a session)
NEEDS = {"ort": "ort", "call": "ort", "pipeline": "ort", "graphs": "torch", "memory": "ort", "predict": "ort"}


def torch_gpu() -> bool:
    """Whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


@functools.cache
def ort_gpu() -> str | None:
    """None when a session asked for CUDA really runs on ONNX Runtime's CUDA provider, else why
    not. ``get_available_providers()`` lists CUDA even where the provider cannot load (a
    missing CUDA or cuDNN library): the session would then run on the CPU, and its timings
    would be reported as a GPU's."""
    if ort is None:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDA provider"
    import onnx
    from onnx import TensorProto, helper

    from placement.runtime.ort.sessions import cuda_provider_error

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(proto)
    try:
        session = ort.InferenceSession(
            proto.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
    except Exception as err:  # noqa: BLE001 - any failure means no CUDA session
        return f"a CUDA session cannot be built: {err}"
    got = session.get_providers()[0]
    if got == "CUDAExecutionProvider":
        return None
    return f"a CUDA session runs on {got}: {cuda_provider_error()}"


def has_gpu() -> bool:
    """Whether torch sees a CUDA GPU and an ONNX Runtime session really runs on CUDA."""
    return torch_gpu() and ort_gpu() is None


def _single(proto: bytes) -> ort.InferenceSession:
    """One CUDA session of the unplaced model, with the options the stage sessions use."""
    from placement.runtime.device_map import PhysicalDevice
    from placement.runtime.ort.sessions import cuda_provider_options, session_options

    physical = PhysicalDevice("cuda", 0)
    providers = [("CUDAExecutionProvider", cuda_provider_options(physical)), "CPUExecutionProvider"]
    return ort.InferenceSession(proto, session_options(physical), providers=providers)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _pairs(
    build: Callable[[], dict[str, Callable[[], Any]]], *, trials: int, repeats: int, block: int
) -> dict:
    """Median ratio (second / first contender) over fresh pairs, and the medians in ms."""
    ratios: list[float] = []
    times: dict[str, list[float]] = {}
    names: list[str] = []
    for _ in range(max(1, trials)):
        fns = build()
        names = list(fns)
        pair = alternate(fns, repeats, warmup=3, block=block).wall
        ratios.append(statistics.median(pair[names[1]]) / statistics.median(pair[names[0]]))
        for key, spent in pair.items():
            times.setdefault(key, []).extend(spent)
    row = {f"{k}_ms": round(statistics.median(v) * 1e3, 4) for k, v in times.items()}
    row.update(ratio=round(statistics.median(ratios), 4), ratio_trials=[round(r, 4) for r in ratios])
    return row


# --- sections -----------------------------------------------------------------------------------


def section_ort(models: Sequence[str], *, trials: int, repeats: int, block: int) -> list[dict[str, Any]]:
    """Placed ORT / single CUDA session, numpy and device-resident I/O, with and without another session."""
    rows = []
    for name in models:
        rows += _ort_model(name, trials=trials, repeats=repeats, block=block)
    return rows


def _ort_model(name: str, *, trials: int, repeats: int, block: int) -> list[dict[str, Any]]:
    import torch

    net, args = model_and_inputs(name, batch=8 if name in ("gpt", "big") else None)
    model = export(net, args)
    placed = pl.place_evenly(model.copy(), 2)
    proto = to_proto(model).SerializeToString()
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    cuda_in = [a.cuda() for a in args]
    keep: list[Any] = []

    def build(io: str, other: bool) -> dict[str, Callable[[], Any]]:
        runner = pl.Runner(placed, device_map=SHARED)
        single = _single(proto)
        keep.clear()
        if other:  # another CUDA session of the same model, alive (and run once) in the process
            keep.append(_single(proto))
            keep[-1].run(None, feeds)
        if io == "numpy":
            return {
                "single": functools.partial(single.run, None, feeds),
                "placed": functools.partial(runner.run, feeds),
            }
        outputs = [o.name for o in single.get_outputs()]

        def single_bound() -> Any:
            binding = single.io_binding()
            for value, tensor in zip(single.get_inputs(), cuda_in):
                binding.bind_input(
                    value.name, "cuda", 0, _np_dtype(tensor), tuple(tensor.shape), tensor.data_ptr()
                )
            for out in outputs:
                binding.bind_output(out, "cuda", 0)
            single.run_with_iobinding(binding)
            return binding.get_outputs()

        return {"single": single_bound, "placed": functools.partial(runner.run, cuda_in, outputs="torch")}

    rows = []
    for other in (False, True):
        for io in ("numpy", "device"):
            row = _pairs(functools.partial(build, io, other), trials=trials, repeats=repeats, block=block)
            row.update(model=name, io=io, other_session=other)
            rows.append(row)
            log.info("ort %s", row)
    keep.clear()
    torch.cuda.empty_cache()
    return rows


def _np_dtype(tensor: Any) -> Any:
    import torch

    return torch.empty((), dtype=tensor.dtype).numpy().dtype


def section_call(*, trials: int, repeats: int, block: int) -> dict[str, Any]:
    """The fixed cost of a stage call: bench gpt in 4 stages vs 2, per extra stage."""
    net, args = model_and_inputs("gpt", batch=8)
    model = export(net, args)
    two, four = pl.place_evenly(model.copy(), 2), pl.place_evenly(model.copy(), 4)
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    on_one = {k: "cuda:0" for k in range(4)}

    def build() -> dict[str, Callable[[], Any]]:
        return {
            "two": functools.partial(pl.Runner(two, device_map=SHARED, fold=False).run, feeds),
            "four": functools.partial(pl.Runner(four, device_map=on_one, fold=False).run, feeds),
        }

    row = _pairs(build, trials=trials, repeats=repeats, block=block)
    row["per_stage_call_ms"] = round((row["four_ms"] - row["two_ms"]) / 2, 4)
    return row


def section_pipeline(models: Sequence[str], *, trials: int, repeats: int, block: int) -> list[dict[str, Any]]:
    """chunks=4 / unpipelined: ORT run and torch train_step; micro-batches on one session beside them."""
    rows = []
    for name in models:
        rows += _pipeline_model(name, trials=trials, repeats=repeats, block=block)
    return rows


def _pipeline_model(name: str, *, trials: int, repeats: int, block: int) -> list[dict[str, Any]]:
    import torch

    net, args = model_and_inputs(name, batch=8)
    model = export(net, args, dynamic=True)
    placed = pl.place_evenly(model.copy(), 2)
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    proto = to_proto(model).SerializeToString()

    def build_ort() -> dict[str, Callable[[], Any]]:
        return {
            "unpipelined": functools.partial(pl.Runner(placed, device_map=SHARED, fold=False).run, feeds),
            "chunks4": functools.partial(
                pl.Runner(placed, device_map=SHARED, chunks=4, fold=False).run, feeds
            ),
        }

    row = _pairs(build_ort, trials=trials, repeats=repeats, block=block)
    single = _single(proto)
    quarters = [{n: a[i * 2 : (i + 1) * 2] for n, a in feeds.items()} for i in range(4)]

    def whole() -> Any:
        return single.run(None, feeds)

    def one_by_one() -> Any:
        return [single.run(None, q) for q in quarters]

    seq = alternate({"whole": whole, "quarters": one_by_one}, repeats, warmup=3, block=block).wall
    row["microbatches_one_session_ratio"] = round(
        statistics.median(seq["quarters"]) / statistics.median(seq["whole"]), 4
    )
    row.update(model=name, runtime="ort run")
    x = args[0].cuda()

    def loss(out: Any) -> Any:
        return out.float().square().mean()

    def step(module: Any) -> None:
        pl.train_step(module, x, loss_fn=loss)
        module.zero_grad(set_to_none=True)
        _sync()

    def build_torch() -> dict[str, Callable[[], Any]]:
        plain = pl.to_torch(placed, device_map=SHARED)
        piped = pl.to_torch(placed, device_map=SHARED, chunks=4)
        return {"unpipelined": functools.partial(step, plain), "chunks4": functools.partial(step, piped)}

    trow = _pairs(build_torch, trials=trials, repeats=max(5, repeats // 3), block=block)
    trow.update(model=name, runtime="torch train_step")
    torch.cuda.empty_cache()
    return [row, trow]


def section_graphs(models: Sequence[str], *, trials: int, repeats: int, block: int) -> list[dict[str, Any]]:
    """CUDA graphs and plain lowering / the eager module, under no_grad."""
    rows = []
    for name in models:
        for contender in ("graphs", "lowered"):
            rows.append(_graphs_model(name, contender, trials=trials, repeats=repeats, block=block))
    return rows


def _graphs_model(name: str, contender: str, *, trials: int, repeats: int, block: int) -> dict[str, Any]:
    import torch

    net, args = model_and_inputs(name)
    placed = pl.place_evenly(export(net, args), 2)
    inputs = [a.cuda() for a in args]

    def call(fn: Any) -> None:
        with torch.no_grad():
            fn(*inputs)
        _sync()

    def build() -> dict[str, Callable[[], Any]]:
        eager = net.cuda()
        module = pl.to_torch(placed, device_map=SHARED, cuda_graphs=contender == "graphs")
        return {"eager": functools.partial(call, eager), contender: functools.partial(call, module)}

    row = _pairs(build, trials=trials, repeats=repeats, block=block)
    row.update(model=name, contender=contender)
    return row


def _memory_child(kind: str, name: str) -> None:
    """In a fresh process: GPU bytes held after building ``kind`` (placed/single) and three runs."""
    import torch

    net, args = model_and_inputs(name, batch=8 if name in ("gpt", "big") else None)
    model = export(net, args)
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    torch.cuda.init()
    free_before, total = torch.cuda.mem_get_info()
    if kind == "placed":
        runner = pl.Runner(pl.place_evenly(model.copy(), 2), device_map=SHARED)
        for _ in range(3):
            runner.run(feeds)
    else:
        single = _single(to_proto(model).SerializeToString())
        for _ in range(3):
            single.run(None, feeds)
    free_after, _ = torch.cuda.mem_get_info()
    print(json.dumps({"bytes": free_before - free_after, "total": total}))


def section_memory(models: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for name in models:
        held = {}
        for kind in ("single", "placed"):
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", kind, name],
                capture_output=True, text=True, check=True, timeout=900,
            )  # fmt: skip
            held[kind] = json.loads(out.stdout.strip().splitlines()[-1])["bytes"]
        ratio = round(held["placed"] / max(1, held["single"]), 4)
        rows.append({"model": name, "single_mib": held["single"] / 2**20,
                     "placed_mib": held["placed"] / 2**20, "ratio": ratio})  # fmt: skip
    return rows


def stage_times(runner: pl.Runner, feeds: Any, *, repeats: int) -> list[float]:
    """Median seconds of each stage of ``runner``'s program run alone (with the transfers after
    it), stages taking turns run by run; a stage on a GPU ends synchronised (ONNX Runtime
    synchronises its stream at the end of each run)."""
    timer = StageTimer(runner, feeds)
    samples = [timer.round() for _ in range(repeats + 2)][2:]  # two warm-up rounds
    return timer.by_device([statistics.median(column) for column in zip(*samples)])


def section_predict(*, repeats: int, dry_run: bool = False) -> list[dict[str, Any]]:
    """The GPT in 2/4/8 stages on the one device, predicted against measured; N-GPU predictions
    (:mod:`benchmarks.gpu_predict`; ``dry_run``: the tiny GPT on the CPU)."""
    from benchmarks.gpu_predict import section_predict as run

    net, args = model_and_inputs("tiny-gpt", batch=8) if dry_run else big_gpt(8)
    return run(net, args, device="cpu" if dry_run else "cuda", repeats=repeats)


def validate_cpu(
    *, size: str = "bench", chunks: Sequence[int] = (1, 2, 4), repeats: int = 20
) -> list[dict[str, Any]]:
    """The predictor against measured pipelines of two devices emulated on the CPU.

    Per ``k``: the stages' times at the micro-batch size (one thread each) and the
    pipelined run (``Runner(chunks=k)``, one thread per stage) are measured in alternation,
    round by round, so load on the machine hits both; the prediction from the stage times'
    medians (times ``k``: whole-batch times) is compared with the run's median."""
    from benchmarks.gpu_predict import _rounds

    net, args = model_and_inputs("tiny-gpt" if size == "tiny" else "gpt", batch=8)
    model = export(net, args, dynamic=True)
    placed = pl.place_evenly(model.copy(), 2)
    feeds = {n: a.numpy() for n, a in zip(model.inputs, args)}
    rows = []
    for k in chunks:
        micro = {n: a[: max(1, a.shape[0] // k)] for n, a in feeds.items()}
        timer = StageTimer(pl.Runner(placed, device_map="cpu", threads=1, fold=False), micro)
        runner = pl.Runner(placed, device_map="cpu", chunks=k, threads_per_stage=1, fold=False)
        stage_times, measured = _rounds(runner, timer, feeds, repeats)
        times = [t * k for t in stage_times]
        (p,) = pl.predict(placed, stage_times=times, links=None, chunks=k)
        rows.append({"chunks": k, "stage_ms": [round(t * 1e3, 3) for t in times],
                     "predicted_ms": round(p.step_s * 1e3, 3), "measured_ms": round(measured * 1e3, 3),
                     "error": round(p.step_s / measured - 1, 4),
                     "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None})  # fmt: skip
    return rows


def _table(results: dict[str, Any]) -> Any:
    from rich.table import Table

    env = results["environment"]
    devices = ", ".join(env.get("cuda_devices") or ["no GPU"])
    table = Table(title=f"placement on {devices} (torch {env['torch']}, onnxruntime {env['onnxruntime']})")
    for col in ("section", "what", "ms", "ratio", "target"):
        table.add_column(col)
    for row in results.get("ort", []):
        what = f"{row['model']} {row['io']} I/O{' + other session' if row['other_session'] else ''}"
        target = TARGETS["ort_big"] if row["model"] == "big" else TARGETS["ort_bench"]
        ms = f"{row['single_ms']:.3f} / {row['placed_ms']:.3f}"
        table.add_row("ort", what, ms, f"{row['ratio']:.3f}", f"<= {target}")
    if "call" in results:
        table.add_row("call", "one more stage call", f"{results['call']['per_stage_call_ms']:.3f}", "", "")
    for row in results.get("pipeline", []):
        extra = row.get("microbatches_one_session_ratio")
        what = f"{row['model']} {row['runtime']}" + (f" (micro-batches alone {extra:.3f})" if extra else "")
        ms = f"{row['unpipelined_ms']:.2f} / {row['chunks4_ms']:.2f}"
        table.add_row("pipeline", what, ms, f"{row['ratio']:.3f}", f"<= {TARGETS['pipeline']}")
    for row in results.get("graphs", []):
        c = row["contender"]
        ms = f"{row['eager_ms']:.3f} / {row[c + '_ms']:.3f}"
        target = TARGETS["graphs" if c == "graphs" else "lowered"]
        table.add_row("graphs", f"{row['model']} {c} / eager", ms, f"{row['ratio']:.3f}", f"<= {target}")
    for row in results.get("memory", []):
        ms = f"{row['single_mib']:.0f} / {row['placed_mib']:.0f} MiB"
        table.add_row("memory", f"{row['model']} placed / single", ms, f"{row['ratio']:.3f}", "<= 1.15")
    for row in results.get("predict", []):
        what = f"gpt, {row['stages']} stages, one device, {row['runtime']} chunks={row['chunks']}"
        ms = f"{row['one_device_predicted_ms']:.2f} vs {row['one_device_measured_ms']:.2f}"
        gpus = f"{row['stages']} GPUs: NVLink {row['nvlink_ms']:.2f} ms, PCIe {row['pcie_ms']:.2f} ms"
        table.add_row("predict", what, ms, f"error {row['one_device_error']:+.3f}", gpus)
    for row in results.get("validate-cpu", []):
        what = f"gpt, 2 emulated devices, chunks={row['chunks']}"
        ms = f"{row['predicted_ms']:.2f} vs {row['measured_ms']:.2f}"
        table.add_row("validate-cpu", what, ms, f"error {row['error']:+.3f}", "")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet", "hf-gpt2", "big"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU smoke: validate-cpu and predict on tiny gpt, few repeats"
    )
    parser.add_argument("--memory-child", nargs=2, metavar=("KIND", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.memory_child:
        _memory_child(*args.memory_child)
        return 0
    on_cpu = ("validate-cpu", "predict") if args.dry_run else ("validate-cpu",)
    if args.dry_run:
        sections = (
            [s for s in args.sections if s in on_cpu] if args.sections != list(SECTIONS) else list(on_cpu)
        )
    else:
        sections = args.sections
    missing = {"torch": None if torch_gpu() else "torch sees no CUDA GPU"}
    if any(s not in on_cpu and NEEDS[s] == "ort" for s in sections):
        missing["ort"] = missing["torch"] or ort_gpu()
    skipped = [s for s in sections if s not in on_cpu and missing.get(NEEDS[s])]
    for s in skipped:
        print(f"benchmarks/gpu.py: section {s} skipped: {missing[NEEDS[s]]}", file=sys.stderr)
    sections = [s for s in sections if s not in skipped]
    if not sections:
        return 0
    results: dict[str, Any] = {"environment": environment(), "targets": TARGETS, "skipped": {
        s: missing[NEEDS[s]] for s in skipped}}  # fmt: skip
    kw = {"trials": args.trials, "repeats": args.repeats, "block": args.block}
    runs: dict[str, Callable[[], Any]] = {
        "ort": lambda: section_ort(args.models, **kw),
        "call": lambda: section_call(**kw),
        "pipeline": lambda: section_pipeline([m for m in ("gpt", "big") if m in args.models or m == "gpt"],
                                             **kw),
        "graphs": lambda: section_graphs(["tiny-gpt", "gpt"], **kw),
        "memory": lambda: section_memory([m for m in args.models if m != "hf-gpt2"]),
        "predict": lambda: section_predict(repeats=3 if args.dry_run else max(5, args.repeats // 3),
                                           dry_run=args.dry_run),
        "validate-cpu": lambda: validate_cpu(size="tiny" if args.dry_run else "bench",
                                             repeats=3 if args.dry_run else args.repeats),
    }  # fmt: skip
    for section in SECTIONS:
        if section in sections:
            results[section] = runs[section]()
            if not args.dry_run:  # written as each section ends: a timeout keeps what was measured
                _save(results, args.out)
    from rich.console import Console

    Console().print(_table(results))
    return 0


def _save(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(results, indent=1, default=str) + "\n")
    partial.replace(out)


if __name__ == "__main__":
    sys.exit(main())
