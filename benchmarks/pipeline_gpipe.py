"""torchgpipe's view of the zoo models, the baseline of ``benchmarks/pipeline.py``'s torch rows.

torchgpipe's ``GPipe`` takes an ``nn.Sequential``: :func:`sequential` rebuilds the bench GPT and
ResNet as one, and :func:`torchgpipe` wraps it with the balance taken from our torch plan
(``None`` where torchgpipe is not installed: ``pip install torchgpipe``, a benchmark-only
dependency).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import placement as pl

__all__ = ["sequential", "torchgpipe"]

log = logging.getLogger("benchmarks.pipeline_gpipe")


class _GPTEmbed(torch.nn.Module):
    def __init__(self, net: Any) -> None:
        super().__init__()
        self.wte, self.wpe = net.wte, net.wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], dtype=torch.int64, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class _GPTHead(torch.nn.Module):
    def __init__(self, net: Any) -> None:
        super().__init__()
        # torchgpipe rejects a parameter shared by two partitions, so the head gets its own
        # copy of the tied embedding weight (same numbers, same cost).
        self.ln_f = net.ln_f
        self.lm_head = torch.nn.Linear(net.lm_head.in_features, net.lm_head.out_features, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(net.lm_head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class _ResNetHead(torch.nn.Module):
    def __init__(self, net: Any) -> None:
        super().__init__()
        self.avgpool, self.fc = net.avgpool, net.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


def sequential(name: str, net: Any) -> tuple[torch.nn.Sequential, list[str]]:
    """The model as an ``nn.Sequential`` for torchgpipe, with each layer's module-path prefix."""
    if name == "gpt":
        layers = [_GPTEmbed(net), *net.blocks, _GPTHead(net)]
        scopes = ["wte", *[f"blocks.{i}" for i in range(len(net.blocks))], "ln_f"]
    else:
        stem = torch.nn.Sequential(net.conv1, net.bn1, net.relu)
        blocks, scopes = [], ["conv1"]
        for i in range(1, net.num_stages + 1):
            for j, block in enumerate(getattr(net, f"layer{i}")):
                blocks.append(block)
                scopes.append(f"layer{i}.{j}")
        layers = [stem, *blocks, _ResNetHead(net)]
        scopes.append("fc")
    return torch.nn.Sequential(*layers), scopes


def _balance(model: pl.Model, scopes: list[str]) -> list[int]:
    """torchgpipe's ``balance`` from our placement: layers whose ops sit mostly on device 0, then the rest."""
    on_first = 0
    first = model.devices[0]
    for scope in scopes:
        ops = [op for op in model.ops if not op.is_copy and (op.scope or "").startswith(scope)]
        if ops and sum(op.device == first for op in ops) * 2 >= len(ops):
            on_first += 1
    on_first = min(max(on_first, 1), len(scopes) - 1)
    return [on_first, len(scopes) - on_first]


def torchgpipe(name: str, net: Any, model: pl.Model, chunks: int) -> tuple[Any, list[int]] | None:
    try:
        from torchgpipe import GPipe
    except ImportError:
        log.warning("torchgpipe is not installed (pip install torchgpipe): its row is left out")
        return None
    seq, scopes = sequential(name, net)
    balance = _balance(model, scopes)
    return GPipe(seq, balance=balance, devices=["cpu", "cpu"], chunks=chunks, checkpoint="never"), balance
