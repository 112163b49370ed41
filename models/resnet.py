"""A small ResNet (torchvision-style ``BasicBlock`` network) for images.

Architecture::

    x (batch, 3, H, W)
      -> conv1 (3x3, stride 1) -> bn1 -> relu                    stem, ``widths[0]`` channels
      -> layer1 .. layerN                                        residual stages
           each: ``blocks[i]`` BasicBlocks; the first block of every stage after the first
           halves H and W (stride 2) and widens to ``widths[i]`` through a 1x1 conv + BN
           projection shortcut named ``downsample``
      -> avgpool (global average) -> flatten -> fc               logits (batch, num_classes)

    BasicBlock: conv1 (3x3) -> bn1 -> relu -> conv2 (3x3) -> bn2 -> (+ shortcut) -> relu

Submodule names follow torchvision (``conv1``, ``bn1``, ``layer1.0.conv2``,
``layer2.0.downsample.0``, ``avgpool``, ``fc``). The stem is CIFAR-style (3x3, no max-pool) because
the images here are small. ``build`` calibrates the BatchNorm running statistics on the example
batch (one train-mode pass), so eval-mode activations have a realistic scale; the BatchNorm affine
parameters are random, so every parameter affects the output. Exports to ONNX ``Conv``,
``BatchNormalization``, ``Relu``, ``Add``, ``ReduceMean`` and ``Gemm``.

Example:
    >>> from placement.models import resnet
    >>> module, (x,) = resnet.build("tiny")
    >>> module(x).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from placement.models._sizes import lookup_size

__all__ = ["SIZES", "BasicBlock", "ResNet", "Size", "build", "calibrate_batchnorm"]


@dataclass(frozen=True)
class Size:
    """A named size: stage widths and depths, classes, and the example batch and image side."""

    widths: tuple[int, ...]
    blocks: tuple[int, ...]
    num_classes: int
    batch: int
    image: int


SIZES: dict[str, Size] = {
    "tiny": Size(widths=(8, 16), blocks=(1, 1), num_classes=10, batch=2, image=16),
    "bench": Size(
        widths=(16, 32, 64, 128),
        blocks=(2, 2, 2, 2),
        num_classes=100,
        batch=8,
        image=64,
    ),
}


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with a residual connection (projected when the shape changes).

    Example:
        >>> import torch
        >>> BasicBlock(4, 8, stride=2)(torch.zeros(1, 4, 8, 8)).shape
        torch.Size([1, 8, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet of :class:`BasicBlock` stages.

    Args:
        widths: channels of each stage (``layer1`` has ``widths[0]``, ...); also the stem width.
        blocks: number of blocks in each stage, same length as ``widths``.
        num_classes: width of the final ``fc`` layer.
        in_channels: image channels.

    Example:
        >>> import torch
        >>> ResNet((4, 8), (1, 1), num_classes=3).eval()(torch.zeros(2, 3, 8, 8)).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        widths: Sequence[int],
        blocks: Sequence[int],
        *,
        num_classes: int = 10,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if not widths or len(widths) != len(blocks) or min(blocks) < 1:
            raise ValueError(f"need one width and >= 1 block per stage, got {widths=} {blocks=}")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        channels = widths[0]
        for i, (width, depth) in enumerate(zip(widths, blocks), start=1):
            stage = [BasicBlock(channels, width, stride=1 if i == 1 else 2)]
            stage += [BasicBlock(width, width) for _ in range(depth - 1)]
            self.add_module(f"layer{i}", nn.Sequential(*stage))
            channels = width
        self.num_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialize all parameters from ``generator``.

        Convs: Kaiming-normal (fan-out). BatchNorm: weight in [0.5, 1.5], bias N(0, 0.1), running
        statistics reset (see :func:`calibrate_batchnorm`). fc: uniform(+-1/sqrt(fan_in)).
        """
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=generator)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5, generator=generator)
                nn.init.normal_(m.bias, 0.0, 0.1, generator=generator)
                m.reset_running_stats()
        bound = self.fc.in_features**-0.5
        nn.init.uniform_(self.fc.weight, -bound, bound, generator=generator)
        nn.init.uniform_(self.fc.bias, -bound, bound, generator=generator)


_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@torch.no_grad()
def calibrate_batchnorm(module: nn.Module, *args: torch.Tensor) -> nn.Module:
    """Set every BatchNorm's running statistics to the batch statistics of one forward pass.

    Leaves ``module`` in eval mode and returns it.

    Example:
        >>> import torch
        >>> net = calibrate_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), torch.randn(8, 2) * 3 + 1)
        >>> bool(net[0].running_var.min() > 1)
        True
    """
    bns = [m for m in module.modules() if isinstance(m, _BATCHNORMS)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        # Cumulative average: after one batch, exactly that batch's statistics.
        m.momentum = None
    module.train()
    module(*args)
    for m, momentum in zip(bns, saved):
        m.momentum = momentum
    return module.eval()


def build(size: str = "tiny", *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a :class:`ResNet` in eval mode and an example image batch, deterministically.

    Args:
        size: ``"tiny"`` (tests) or ``"bench"`` (benchmarks), see :data:`SIZES`.
        seed: seeds a local ``torch.Generator``; the global RNG state is left untouched.

    Returns:
        ``(module, (x,))`` with ``x`` of shape ``(batch, 3, image, image)``, float32.

    Example:
        >>> module, (x,) = build("tiny", seed=1)
        >>> tuple(x.shape)
        (2, 3, 16, 16)
    """
    cfg = _size(size)
    generator = torch.Generator().manual_seed(seed)
    # The constructor's default init must not disturb the global RNG.
    with torch.random.fork_rng(devices=[]):
        module = ResNet(cfg.widths, cfg.blocks, num_classes=cfg.num_classes)
    module.reset_parameters(generator)
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=generator)
    return calibrate_batchnorm(module, x), (x,)


def _size(size: str) -> Size:
    return lookup_size(SIZES, size, "ResNet")
