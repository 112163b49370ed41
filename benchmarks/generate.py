"""Benchmark: generating with a causal LM, placement's decode loops against the usual ways.

Greedy decoding, prompt 16 tokens, 64 new tokens (no end of sequence), batch 1 and 8, on a
tiny Llama (4 layers, d=256, GQA 8/4 heads, vocab 1000) and an 8-layer d=1024 one (GQA 16/8),
random weights. Side by side in one run, tokens per second (new tokens x batch / seconds,
best of ``--repeats`` rounds after a warm-up, each round timing every contender once, so load
swings hit all alike), every contender checked to give the same tokens as
the first:

* ``ort loop``: one ONNX Runtime session of the unplaced graph (``pl.from_causal_lm``), in a
  Python loop, numpy in and out, the present caches fed back as the next past;
* ``transformers``: ``model.generate`` (eager, its own KV cache);
* ``placed ort folded``: ``pl.Generator`` on the model placed on 2 devices, ``device_map="cpu"``
  (one session: the placement folds);
* ``placed ort 2 dev``: the same on 2 emulated devices (a session per device, caches in each
  session's buffers, the hidden state handed over per token);
* ``placed torch``: ``pl.Generator(runtime="torch", device_map="cpu")`` (static cache);
* batch 8 only: ``placed ort 2 dev chunks=2`` (two groups of 4 in flight) against
  ``placed ort 2 dev, core share`` (``chunks=1`` with each emulated device's session given
  the same threads as in the ``chunks=2`` run: the CPU's cores divided among the devices, as
  two GPUs each bring their own compute): the ratio ``chunks=2 / chunks=1`` compares the two
  at equal cores per device; ``chunks=2 / chunks=1, all cores`` against ``placed ort 2 dev``,
  whose sessions each use every core in turn;
* ``genai``: onnxruntime-genai's ``og.Generator`` on a model its own builder made from the same
  weights (``save_pretrained``, then ``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``).
  genai brings plain ``onnxruntime``, so it runs in a Python of its own, named by
  ``PLACEMENT_GENAI_PYTHON`` (or ``--genai-python``): a server process there times each of its
  generations in the same rounds as the others (:class:`benchmarks.genai_anchor.GenaiServer`).
  Without that Python the column is empty and the reason is printed. Its tokens are compared
  with the others' (``genai_tokens_equal``) but not required to match: its graph fuses attention
  differently, and a near tie can pick another token;
* ``placed ort folded, genai file`` and ``placed ort 2 dev, genai file``: placement's loop on
  genai's own file (``pl.load``), which must give genai's tokens; empty, with the reason in the
  results, where placement cannot generate from that file.

:data:`CONTENDERS` maps a column to the function measuring it; a contender that cannot run here
returns None. Ratios: placed ORT to genai (the targets: 0.9 folded, 0.7 on 2 devices on the tiny
model, 0.9 on 2 devices on the d=1024 one) and to the ORT loop, placed torch to transformers,
chunks=2 to chunks=1 (at equal cores per device, and against all cores). Writes
``benchmarks/results/generate.json`` with the load average.

Usage::

    PLACEMENT_GENAI_PYTHON=/path/to/genai-venv/bin/python python benchmarks/generate.py
    python benchmarks/generate.py --quick              # tiny model only, 2 rounds: ~3 minutes
    python benchmarks/generate.py --models tiny --repeats 3
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import placement as pl  # noqa: E402
from benchmarks.genai_anchor import ENV  # noqa: E402
from benchmarks.harness import write_results  # noqa: E402
from placement.runtime.schedule import stage_threads  # noqa: E402

PROMPT, NEW = 16, 64
MODELS = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "d1024": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}
TARGETS: dict[str, float | None] = {
    "placed ort folded / genai": 0.9,
    "placed ort 2 dev / genai": 0.7,  # 0.9 on the d=1024 model
    "placed ort folded, genai file / genai": 0.9,
    "placed ort 2 dev, genai file / genai": 0.7,
    "placed ort folded / ort loop": None,
    "placed ort 2 dev / ort loop": None,
    "placed torch / transformers": 1.0,
    "chunks=2 / chunks=1": 1.6,  # at equal cores per device
    "chunks=2 / chunks=1, all cores": None,
}


@dataclass
class Setup:
    """One model at one batch: the module, its exported graph, the placed graph, the prompt."""

    name: str
    net: Any
    model: pl.Model
    placed: pl.Model
    onnx_path: Path
    ids: np.ndarray
    reference: np.ndarray | None = None
    generators: dict[str, Any] = field(default_factory=dict)
    genai: Path | str | None = None  # the genai-built folder, or why there is none
    notes: dict[str, Any] = field(default_factory=dict)


#: A warmed-up contender: one generation, its tokens (or tokens and the seconds it timed itself).
Run = Callable[[], "np.ndarray | tuple[np.ndarray, float]"]
Contender = Callable[[Setup, int], "Run | None"]
CONTENDERS: dict[str, Contender] = {}


def contender(name: str) -> Callable[[Contender], Contender]:
    """Register a column: ``fn(setup, repeats) -> run``, a warmed-up call generating the tokens
    (None: not measured here)."""

    def register(fn: Contender) -> Contender:
        CONTENDERS[name] = fn
        return fn

    return register


def _best(run: Callable[[], np.ndarray], setup: Setup, repeats: int) -> Run:
    """Warm ``run`` up (sessions, caches), check its tokens against the first contender's, hand it back
    (:func:`main` times the contenders in turn, one run each per round, so load swings hit all alike)."""
    out = run()
    if setup.reference is None:
        setup.reference = out
    elif not np.array_equal(out, setup.reference):
        raise AssertionError("a contender's tokens differ from the first contender's")
    return run


@contender("ort loop")
def ort_loop(setup: Setup, repeats: int) -> Run:
    session = ort.InferenceSession(str(setup.onnx_path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    past_shape = {i.name: i.shape for i in session.get_inputs()}

    def run() -> np.ndarray:
        batch = setup.ids.shape[0]
        feeds: dict[str, np.ndarray] = {
            n: np.zeros((batch, past_shape[n][1], 0, past_shape[n][3]), np.float32)
            for n in names
            if n.startswith("past_key_values")
        }
        ids = setup.ids
        mask = np.ones_like(ids)
        feeds.update(
            input_ids=ids, attention_mask=mask, position_ids=np.arange(ids.shape[1])[None].repeat(batch, 0)
        )
        tokens = []
        for step in range(NEW):
            result = session.run(None, feeds)
            token = result[0][:, -1].argmax(-1)[:, None].astype(np.int64)
            tokens.append(token)
            for name, value in zip(outputs[1:], result[1:]):
                feeds[name.replace("present", "past_key_values")] = value
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], 1)
            feeds.update(
                input_ids=token, attention_mask=mask, position_ids=np.full((batch, 1), PROMPT + step)
            )
        return np.concatenate([setup.ids, *tokens], 1)

    return _best(run, setup, repeats)


@contender("transformers")
def transformers_generate(setup: Setup, repeats: int) -> Run:
    ids = torch.from_numpy(setup.ids)

    def run() -> np.ndarray:
        with torch.no_grad():
            out = setup.net.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )
        return out.numpy()

    return _best(run, setup, repeats)


def _placed(setup: Setup, repeats: int, key: str, **options: Any) -> Run:
    generator = setup.generators.get(key)
    if generator is None:
        generator = setup.generators[key] = pl.Generator(setup.placed, **options)
    return _best(lambda: generator.generate(setup.ids, max_new_tokens=NEW), setup, repeats)


@contender("placed ort folded")
def placed_folded(setup: Setup, repeats: int) -> Run:
    return _placed(setup, repeats, "folded", device_map="cpu")


@contender("placed ort 2 dev")
def placed_two(setup: Setup, repeats: int) -> Run:
    return _placed(setup, repeats, "two", device_map="auto")


@contender("placed torch")
def placed_torch(setup: Setup, repeats: int) -> Run:
    return _placed(setup, repeats, "torch", runtime="torch", device_map="cpu")


@contender("placed ort 2 dev, core share")
def placed_two_share(setup: Setup, repeats: int) -> Run | None:
    if setup.ids.shape[0] < 8:
        return None
    share = stage_threads(2)  # what chunks=2 gives each device's sessions
    return _placed(setup, repeats, "share", device_map="auto", threads_per_stage=share)


@contender("placed ort 2 dev chunks=2")
def placed_chunks(setup: Setup, repeats: int) -> Run | None:
    if setup.ids.shape[0] < 8:
        return None
    return _placed(setup, repeats, "chunks", device_map="auto", chunks=2)


@contender("genai")
def genai(setup: Setup, repeats: int) -> Run | None:
    """onnxruntime-genai in its own Python (see the module docstring); None where there is none."""
    from benchmarks.genai_anchor import GenaiServer

    if not isinstance(setup.genai, Path):
        return None
    ids_file = setup.genai / f"ids_{setup.ids.shape[0]}.npy"
    np.save(ids_file, setup.ids)
    server = GenaiServer(os.environ[ENV], setup.genai, str(ids_file), NEW)
    atexit.register(server.close)
    first = server.run()
    tokens = np.array(first["tokens"], np.int64)
    setup.notes["genai_tokens"] = tokens
    setup.notes["genai_tokens_equal"] = setup.reference is not None and np.array_equal(
        tokens, setup.reference
    )

    def run() -> tuple[np.ndarray, float]:
        out = server.run()
        return np.array(out["tokens"], np.int64), float(out["seconds"])

    return run


def _on_genai_file(setup: Setup, key: str, devices: int) -> Run | None:
    """placement's ORT loop on genai's own file (the same graph genai runs), placed on
    ``devices`` (1: folded); None where there is no genai file or placement cannot generate
    from it (the reason goes to the row). Its tokens must be genai's."""
    tokens = setup.notes.get("genai_tokens")
    if not isinstance(setup.genai, Path) or tokens is None:
        return None
    try:
        model = pl.load(setup.genai / "model.onnx")
        if devices > 1:
            pl.auto_place(model, devices=devices, cost="flops")
        generator = pl.Generator(model, device_map="cpu" if devices == 1 else "auto")
        out = generator.generate(setup.ids, max_new_tokens=NEW)
    except pl.PlacementError as err:
        setup.notes[f"{key} skipped"] = str(err).splitlines()[0]
        return None
    if not np.array_equal(out, tokens):
        # genai runs its own onnxruntime release: on wide random-weight models a near tie in
        # the logits can break the other way; the row says from which step, and is still timed
        same = np.cumprod(np.asarray(out) == np.asarray(tokens), axis=-1).sum(axis=-1)
        first = int(same.min()) - setup.ids.shape[-1]
        setup.notes[f"{key} tokens"] = f"differ from genai's from new token {first} on (a near tie)"
    return lambda: generator.generate(setup.ids, max_new_tokens=NEW)


@contender("placed ort folded, genai file")
def placed_folded_genai_file(setup: Setup, repeats: int) -> Run | None:
    return _on_genai_file(setup, "placed ort folded, genai file", 1)


@contender("placed ort 2 dev, genai file")
def placed_two_genai_file(setup: Setup, repeats: int) -> Run | None:
    return _on_genai_file(setup, "placed ort 2 dev, genai file", 2)


_MODELS: dict[str, tuple[Any, pl.Model, pl.Model, Path, Path | str | None]] = {}


def _model(name: str) -> tuple[Any, pl.Model, pl.Model, Path, Path | str | None]:
    """The module, its export, the placed copy, the export's file and the genai folder (or why
    none) of model ``name``: built once per run, files in a folder removed at exit."""
    if name in _MODELS:
        return _MODELS[name]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, max_position_embeddings=256, **MODELS[name])
    net = LlamaForCausalLM(config).eval()
    net.generation_config.eos_token_id = None  # exactly NEW tokens, as every contender
    net.generation_config.pad_token_id = 0
    model = pl.from_causal_lm(net, torch.randint(0, 1000, (1, 3)))
    folder = Path(tempfile.mkdtemp(prefix=f"generate_bench_{name}_"))
    atexit.register(shutil.rmtree, folder, True)
    model.save(folder / "model.onnx")
    placed = model.copy()
    pl.auto_place(placed, devices=2, cost="flops")
    _MODELS[name] = (net, model, placed, folder / "model.onnx", _genai_folder(net, folder))
    return _MODELS[name]


def _genai_folder(net: Any, folder: Path) -> Path | str:
    """genai's build of ``net`` (same weights) under ``folder``, or why there is none."""
    from benchmarks.genai_anchor import build_genai_model

    python = os.environ.get(ENV)
    if not python or not Path(python).exists():
        return f"{ENV} names no Python with onnxruntime-genai ({python!r})"
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_genai_files import save_tiny_tokenizer  # the builder reads a tokenizer

    hf = folder / "hf"
    net.save_pretrained(hf)
    save_tiny_tokenizer(hf, net.config.vocab_size)
    out = folder / "genai"
    reason = build_genai_model(python, hf, out)
    return out if reason is None else reason


def _setup(name: str, batch: int) -> Setup:
    net, model, placed, path, genai_folder = _model(name)
    ids = np.random.default_rng(0).integers(1, 1000, (batch, PROMPT)).astype(np.int64)
    return Setup(name, net, model, placed, path, ids, genai=genai_folder)


def _ratios(tps: dict[str, float | None]) -> dict[str, float]:
    """The ratios of one row (those whose contenders both ran)."""
    pairs = {
        "placed ort folded / genai": ("placed ort folded", "genai"),
        "placed ort 2 dev / genai": ("placed ort 2 dev", "genai"),
        "placed ort folded, genai file / genai": ("placed ort folded, genai file", "genai"),
        "placed ort 2 dev, genai file / genai": ("placed ort 2 dev, genai file", "genai"),
        "placed ort folded / ort loop": ("placed ort folded", "ort loop"),
        "placed ort 2 dev / ort loop": ("placed ort 2 dev", "ort loop"),
        "placed torch / transformers": ("placed torch", "transformers"),
        "chunks=2 / chunks=1": ("placed ort 2 dev chunks=2", "placed ort 2 dev, core share"),
        "chunks=2 / chunks=1, all cores": ("placed ort 2 dev chunks=2", "placed ort 2 dev"),
    }
    return {
        key: round(tps[a] / tps[b], 3)  # type: ignore[operator]
        for key, (a, b) in pairs.items()
        if tps.get(a) and tps.get(b)
    }


def _measure(name: str, batch: int, repeats: int) -> dict[str, Any]:
    """One row: every contender warmed up, then ``repeats`` rounds, each timing every contender once."""
    setup = _setup(name, batch)
    row: dict[str, Any] = {"model": name, "batch": batch, "tokens_per_s": {}}
    runs = {column: fn(setup, repeats) for column, fn in CONTENDERS.items()}
    best = {column: float("inf") for column in runs}
    for _ in range(repeats):
        for column, run in runs.items():
            if run is not None:
                start = time.perf_counter()
                out = run()
                seconds = out[1] if isinstance(out, tuple) else time.perf_counter() - start
                best[column] = min(best[column], seconds)
    for column, run in runs.items():
        value = None if run is None else batch * NEW / best[column]
        row["tokens_per_s"][column] = None if value is None else round(value, 1)
        shown = "-" if value is None else f"{value:.1f}"
        print(f"{name} batch {batch} {column}: {shown} tokens/s", flush=True)
    row["ratios"] = _ratios(row["tokens_per_s"])
    row["load_average"] = [round(x, 2) for x in os.getloadavg()]  # after the row's rounds
    if isinstance(setup.genai, str):
        row["genai"] = setup.genai
        print(f"{name}: no genai column: {setup.genai}", flush=True)
    row.update({k: v for k, v in setup.notes.items() if k != "genai_tokens"})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 2 rounds (a smoke run)")
    parser.add_argument(
        "--genai-python", help=f"the Python of a venv with onnxruntime-genai (default: ${ENV})"
    )
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "generate.json"))
    args = parser.parse_args(argv)
    if args.genai_python:
        os.environ[ENV] = args.genai_python
    if args.quick:
        args.models, args.repeats = ["tiny"], 2
    load_before = os.getloadavg()
    results = [_measure(name, batch, args.repeats) for name in args.models for batch in args.batches]
    data = {
        "prompt": PROMPT,
        "new_tokens": NEW,
        "repeats": args.repeats,
        "models": {k: MODELS[k] for k in args.models},
        "targets": TARGETS,
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "cpus": os.cpu_count(),
        "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__},
        "results": results,
    }
    write_results(Path(args.output), data)
    header = ["model", "batch", *CONTENDERS, *TARGETS]
    print(" | ".join(header))
    for r in results:
        cells = [r["model"], str(r["batch"])]
        cells += ["-" if r["tokens_per_s"][c] is None else f"{r['tokens_per_s'][c]:.0f}" for c in CONTENDERS]
        cells += [f"{r['ratios'][t]:.2f}" if t in r["ratios"] else "-" for t in TARGETS]
        print(" | ".join(cells))
    print(f"load average before {data['load_average']['before']}, after {data['load_average']['after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
