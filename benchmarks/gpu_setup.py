"""What the GPU benchmarks share: their models, the export, a timer of a runner's stages.

:func:`big_gpt` is the 160M-parameter GPT of ``benchmarks/gpu.py``; :func:`model_and_inputs`
names it, the tiny GPT or a bench model of ``benchmarks/runtime.py``; :func:`export` imports
one (optionally with a dynamic batch); :class:`StageTimer` times each stage of a runner's
compiled program alone. ``gpu.py``, ``gpu_predict.py`` and ``gpu_diagnose.py`` import them
from here, so none of them imports another back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import placement as pl
from benchmarks.runtime import build_model

__all__ = ["StageTimer", "big_gpt", "export", "model_and_inputs"]


def big_gpt(batch: int = 8, *, seed: int = 0) -> tuple[Any, tuple[Any, ...]]:
    """The big GPT: 12 layers, d=1024, 16 heads, vocabulary 8192, sequence 512 (160M parameters)."""
    import torch

    from placement.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=8192, block_size=512, n_layer=12, n_head=16, d_model=1024)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        net = GPT(config)
    net.reset_parameters(generator)
    idx = torch.randint(config.vocab_size, (batch, 512), generator=generator)
    return net.eval(), (idx,)


def model_and_inputs(name: str, *, batch: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    """``big``, ``tiny-gpt`` or a bench model of ``benchmarks/runtime.py`` (its batch repeated up
    to ``batch``)."""
    import torch

    if name == "big":
        return big_gpt(batch or 8)
    size, base = ("tiny", "gpt") if name == "tiny-gpt" else ("bench", name)
    net, args = build_model(base, size)
    if batch:
        args = tuple(torch.cat([a] * -(-batch // a.shape[0]))[:batch] for a in args)
    return net, args


def export(net: Any, args: tuple[Any, ...], *, dynamic: bool = False) -> pl.Model:
    import torch

    shapes = tuple({0: torch.export.Dim("batch")} for _ in args) if dynamic else None
    return pl.from_torch(net, args, dynamic_shapes=shapes)


class StageTimer:
    """Times each stage (with the transfers after it) of a runner's program once per :meth:`round`."""

    def __init__(self, runner: pl.Runner, feeds: Any) -> None:
        from placement.runtime.ort.steps import TransferStep

        self.program = runner.program
        self.arrays = [feeds[name] for name in runner.input_names]
        self.groups: list[list[Any]] = []
        for step in self.program.steps:
            if not isinstance(step, TransferStep) or not self.groups:
                self.groups.append([])
            self.groups[-1].append(step)
        self.timed = [any(not isinstance(x, TransferStep) for x in group) for group in self.groups]
        #: the logical device of each timed group, in run order
        self.devices = [
            next(x.exec.stage.device for x in group if not isinstance(x, TransferStep))
            for group, timed in zip(self.groups, self.timed)
            if timed
        ]

    def by_device(self, times: Sequence[float]) -> list[float]:
        """Per-stage ``times`` summed per logical device, devices in order of first use (the
        stages of a plan's part, as ``pl.predict`` counts them)."""
        totals: dict[Any, float] = {}
        for device, spent in zip(self.devices, times):
            totals[device] = totals.get(device, 0.0) + spent
        return list(totals.values())

    def round(self) -> list[float]:
        values = self.program.feed(self.arrays)
        spent = []
        for group, timed in zip(self.groups, self.timed):
            start = time.perf_counter()
            for step in group:
                step.run(values)
            if timed:
                spent.append(time.perf_counter() - start)
        return spent
