"""``pl.predict`` with tensor parallelism on 2, 4 and 8 GPUs over NVLink: when a split pays.

A 2-layer GPT of width 1024 (8 heads, vocabulary 4096) at 2, 128 and 2048 tokens per
step. Op times are analytic FLOPs at 50 TFLOP/s (``DEFAULT_FLOPS["cuda"]``, a data-centre
GPU in float32), copies go over the ``"nvlink"`` link preset (150 GB/s, 3 us), each
collective pays :data:`placement.planning.tp_cost.COLLECTIVE_LATENCY_S`. Nothing is measured,
so the table is the same on every machine: ``docs/tensor-parallel.md`` shows it and
``tests/planning/test_tp_docs.py`` checks that it is this script's output.

Run::

    python benchmarks/tp_predict.py           # print the markdown table
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

import placement as pl
from placement.models.gpt import GPT, GPTConfig
from placement.planning.speeds import DEFAULT_FLOPS

__all__ = ["CONFIG", "GPUS", "TOKENS", "render", "main"]

CONFIG = GPTConfig(vocab_size=4096, block_size=128, n_layer=2, n_head=8, d_model=1024)
TOKENS = (2, 128, 2048)
GPUS = (2, 4, 8)
OPTIONS = {"links": "nvlink", "throughput": {"cuda": DEFAULT_FLOPS["cuda"]}}


def _model(tokens: int) -> pl.Model:
    torch.manual_seed(0)
    net = GPT(CONFIG).eval()
    seq = min(tokens, CONFIG.block_size)
    idx = torch.zeros((tokens // seq, seq), dtype=torch.int64)
    return pl.from_torch(net, (idx,))


def _stages(p: pl.Prediction) -> str:
    degrees = p.extra.get("tensor_parallel", [1])
    return f"{len(degrees)} x {degrees[0]}" if len(degrees) > 1 else f"1 x {degrees[0]}"


def rows(tokens: Sequence[int] = TOKENS, gpus: Sequence[int] = GPUS) -> list[list[str]]:
    """One row per (tokens per step, GPUs): the split over all GPUs, and ``"auto"``'s choice."""
    found = []
    for count in tokens:
        model = _model(count)
        for n in gpus:
            (split,) = pl.predict(model, gpus=n, tensor_parallel=n, **OPTIONS)
            (auto,) = pl.predict(model, gpus=n, tensor_parallel="auto", **OPTIONS)
            found.append([
                str(count),
                str(n),
                f"{split.single_s * 1e3:.3f}",
                f"{split.step_s * 1e3:.3f}",
                f"{sum(split.extra['collective_s']) * 1e3:.3f}",
                f"{split.speedup:.2f}",
                _stages(auto),
                f"{auto.speedup:.2f}",
            ])  # fmt: skip
    return found


HEADER = [
    "tokens per step",
    "GPUs",
    "one GPU ms",
    "split over all: step ms",
    "of which collectives ms",
    "speed-up",
    "auto: stages x degree",
    "auto speed-up",
]


def render(tokens: Sequence[int] = TOKENS, gpus: Sequence[int] = GPUS) -> str:
    """The markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(tokens, gpus)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    sys.stdout.write(render() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
