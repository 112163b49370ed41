"""A small U-Net: convolutional encoder-decoder with long skip connections.

Architecture (``widths = (w1, ..., wn)``, ``n - 1`` resolution levels below the input)::

    x (batch, in_channels, H, W)
      -> enc1 (DoubleConv -> w1)             ------------------------------- skip 1 ---+
      -> down1 (2x2 max-pool) -> enc2 (w2)   ------------- skip 2 ---+                 |
      -> ...                                                         |                 |
      -> down<n-1> -> bottleneck (wn)                                |                 |
      -> up<n-1> (2x upsample to w<n-1>) -> cat(skip n-1, .) -> dec<n-1> (DoubleConv)  |
      -> ...                                                                           |
      -> up1 -> cat(skip 1, .) -> dec1 ------------------------------------------------+
      -> head (1x1 conv)                     y (batch, out_channels, H, W)

    DoubleConv: (3x3 conv -> GroupNorm -> ReLU) x 2, submodules ``conv1 norm1 conv2 norm2``

Upsampling is a stride-2 ``ConvTranspose2d`` by default, or nearest-neighbour ``interpolate``
followed by a 1x1 conv with ``upsample="nearest"``. ``H`` and ``W`` must be divisible by
``2 ** (len(widths) - 1)``. Exports to ONNX ``Conv``, ``ConvTranspose`` (or ``Resize``),
``MaxPool``, ``Concat``, ``Relu`` and GroupNorm's decomposition (``Reshape``,
``InstanceNormalization``, ``Mul``, ``Add``).

Example:
    >>> from placement.models import unet
    >>> module, (x,) = unet.build("tiny")
    >>> module(x).shape
    torch.Size([2, 2, 16, 16])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from placement.models._sizes import lookup_size

__all__ = ["SIZES", "DoubleConv", "Size", "UNet", "Up", "build"]

Upsample = Literal["transpose", "nearest"]


@dataclass(frozen=True)
class Size:
    """A named size: widths per level, channels, and the example batch and image side."""

    widths: tuple[int, ...]
    in_channels: int
    out_channels: int
    batch: int
    image: int


SIZES: dict[str, Size] = {
    "tiny": Size(widths=(8, 16, 32), in_channels=3, out_channels=2, batch=2, image=16),
    "bench": Size(widths=(16, 32, 64, 128), in_channels=3, out_channels=2, batch=8, image=64),
}


def _groups(channels: int) -> int:
    """GroupNorm groups: channels / 4 capped at 8 (and at least 1)."""
    return max(1, min(8, channels // 4))


class DoubleConv(nn.Module):
    """``(3x3 conv -> GroupNorm -> ReLU) x 2``; keeps the spatial size.

    Example:
        >>> import torch
        >>> DoubleConv(3, 8)(torch.zeros(1, 3, 5, 5)).shape
        torch.Size([1, 8, 5, 5])
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(out_channels), out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(out_channels), out_channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(x)))


class Up(nn.Module):
    """Double the spatial size and map ``in_channels`` to ``out_channels``.

    Example:
        >>> import torch
        >>> Up(8, 4, mode="nearest")(torch.zeros(1, 8, 3, 3)).shape
        torch.Size([1, 4, 6, 6])
    """

    def __init__(self, in_channels: int, out_channels: int, *, mode: Upsample = "transpose") -> None:
        super().__init__()
        if mode not in ("transpose", "nearest"):
            raise ValueError(f"unknown upsample mode {mode!r}; known: 'transpose', 'nearest'")
        self.mode = mode
        if mode == "transpose":
            self.conv = nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)
        else:
            self.conv = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "nearest":
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(x)


class UNet(nn.Module):
    """U-Net with ``len(widths)`` levels (the last one is the bottleneck).

    Args:
        widths: channels at each level, from the input resolution down to the bottleneck.
        in_channels: input image channels.
        out_channels: channels of the per-pixel output (``head``).
        upsample: ``"transpose"`` (``ConvTranspose2d``) or ``"nearest"`` (interpolate + 1x1 conv).

    Example:
        >>> import torch
        >>> UNet((4, 8), in_channels=1, out_channels=3)(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 3, 8, 8])
    """

    def __init__(
        self,
        widths: Sequence[int],
        *,
        in_channels: int = 3,
        out_channels: int = 2,
        upsample: Upsample = "transpose",
    ) -> None:
        super().__init__()
        if len(widths) < 2:
            raise ValueError(f"a U-Net needs at least two levels, got widths={tuple(widths)}")
        self.levels = len(widths) - 1  # resolution levels above the bottleneck
        channels = in_channels
        for i, width in enumerate(widths[:-1], start=1):
            self.add_module(f"enc{i}", DoubleConv(channels, width))
            self.add_module(f"down{i}", nn.MaxPool2d(2))
            channels = width
        self.bottleneck = DoubleConv(channels, widths[-1])
        for i in range(self.levels, 0, -1):
            self.add_module(f"up{i}", Up(widths[i], widths[i - 1], mode=upsample))
            self.add_module(f"dec{i}", DoubleConv(2 * widths[i - 1], widths[i - 1]))
        self.head = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i in range(1, self.levels + 1):
            x = getattr(self, f"enc{i}")(x)
            skips.append(x)
            x = getattr(self, f"down{i}")(x)
        x = self.bottleneck(x)
        for i in range(self.levels, 0, -1):
            x = getattr(self, f"up{i}")(x)
            x = getattr(self, f"dec{i}")(torch.cat([skips[i - 1], x], dim=1))
        return self.head(x)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-initialize all parameters from ``generator``.

        Convs: Kaiming-normal (fan-in), biases N(0, 0.1); GroupNorm weight in
        [0.5, 1.5], bias N(0, 0.1) (not the identity, so every parameter affects the output).
        """
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                if m.bias is not None:
                    nn.init.normal_(m.bias, 0.0, 0.1, generator=generator)
            elif isinstance(m, nn.GroupNorm):
                nn.init.uniform_(m.weight, 0.5, 1.5, generator=generator)
                nn.init.normal_(m.bias, 0.0, 0.1, generator=generator)


def build(size: str = "tiny", *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a :class:`UNet` in eval mode and an example image batch, deterministically.

    Args:
        size: ``"tiny"`` (tests) or ``"bench"`` (benchmarks), see :data:`SIZES`.
        seed: seeds a local ``torch.Generator``; the global RNG state is left untouched.

    Returns:
        ``(module, (x,))`` with ``x`` of shape ``(batch, in_channels, image, image)``, float32.

    Example:
        >>> module, (x,) = build("tiny", seed=1)
        >>> tuple(x.shape)
        (2, 3, 16, 16)
    """
    cfg = _size(size)
    generator = torch.Generator().manual_seed(seed)
    # The constructor's default init must not disturb the global RNG.
    with torch.random.fork_rng(devices=[]):
        module = UNet(cfg.widths, in_channels=cfg.in_channels, out_channels=cfg.out_channels)
    module.reset_parameters(generator)
    x = torch.randn(cfg.batch, cfg.in_channels, cfg.image, cfg.image, generator=generator)
    return module.eval(), (x,)


def _size(size: str) -> Size:
    return lookup_size(SIZES, size, "U-Net")
