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
* batch 8 only: ``placed ort 2 dev chunks=2`` (two groups of 4 in flight) against the
  ``chunks=1`` row.

:data:`CONTENDERS` maps a column to the function measuring it (``setup -> tokens/s``); a
contender that cannot run here (onnxruntime-genai needs a venv of its own, see
``--genai-python``) registers with :func:`contender` and returns None. Ratios are to
``ort loop``. Writes ``benchmarks/results/generate.json`` with the load average.

Usage::

    python benchmarks/generate.py                      # both models, batch 1 and 8
    python benchmarks/generate.py --models tiny --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
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
TARGETS = {
    "placed ort folded": 0.9,
    "placed ort 2 dev": 0.7,
    "placed torch / transformers": 1.0,
    "chunks=2 / chunks=1": 1.6,
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


Run = Callable[[], np.ndarray]
Contender = Callable[[Setup, int], "Run | None"]
CONTENDERS: dict[str, Contender] = {}


def contender(name: str) -> Callable[[Contender], Contender]:
    """Register a column: ``fn(setup, repeats) -> run``, a warmed-up call generating the tokens
    (None: not measured here)."""

    def register(fn: Contender) -> Contender:
        CONTENDERS[name] = fn
        return fn

    return register


def _best(run: Run, setup: Setup, repeats: int) -> Run:
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


@contender("placed ort 2 dev chunks=2")
def placed_chunks(setup: Setup, repeats: int) -> Run | None:
    if setup.ids.shape[0] < 8:
        return None
    return _placed(setup, repeats, "chunks", device_map="auto", chunks=2)


@contender("genai")
def genai(setup: Setup, repeats: int) -> Run | None:
    """onnxruntime-genai brings plain onnxruntime: it runs from a venv of its own (``--genai-python``);
    the column is filled by the genai runner where one is set up (None here otherwise)."""
    return None


def _setup(name: str, batch: int) -> Setup:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, max_position_embeddings=256, **MODELS[name])
    net = LlamaForCausalLM(config).eval()
    net.generation_config.eos_token_id = None  # exactly NEW tokens, as every contender
    net.generation_config.pad_token_id = 0
    model = pl.from_causal_lm(net, torch.randint(0, 1000, (1, 3)))
    folder = Path(tempfile.mkdtemp(prefix="generate_bench_"))
    model.save(folder / "model.onnx")
    placed = model.copy()
    pl.auto_place(placed, devices=2, cost="flops")
    ids = np.random.default_rng(0).integers(1, 1000, (batch, PROMPT)).astype(np.int64)
    return Setup(name, net, model, placed, folder / "model.onnx", ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "generate.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    results = []
    for name in args.models:
        for batch in args.batches:
            setup = _setup(name, batch)
            row: dict[str, Any] = {"model": name, "batch": batch, "tokens_per_s": {}}
            runs = {column: fn(setup, args.repeats) for column, fn in CONTENDERS.items()}
            best = {column: float("inf") for column in runs}
            for _ in range(args.repeats):  # rounds: each contender once per round
                for column, run in runs.items():
                    if run is not None:
                        start = time.perf_counter()
                        run()
                        best[column] = min(best[column], time.perf_counter() - start)
            for column, run in runs.items():
                value = None if run is None else batch * NEW / best[column]
                row["tokens_per_s"][column] = None if value is None else round(value, 1)
                shown = "-" if value is None else f"{value:.1f}"
                print(f"{name} batch {batch} {column}: {shown} tokens/s", flush=True)
            tps = row["tokens_per_s"]
            loop = tps["ort loop"]
            row["ratios"] = {
                "placed ort folded": tps["placed ort folded"] / loop,
                "placed ort 2 dev": tps["placed ort 2 dev"] / loop,
                "placed torch / transformers": tps["placed torch"] / tps["transformers"],
            }
            if tps.get("placed ort 2 dev chunks=2"):
                row["ratios"]["chunks=2 / chunks=1"] = (
                    tps["placed ort 2 dev chunks=2"] / tps["placed ort 2 dev"]
                )
            row["ratios"] = {k: round(v, 3) for k, v in row["ratios"].items()}
            results.append(row)
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
    Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
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
