"""Model zoo: small but complete PyTorch models for tests, examples and benchmarks.

Every model module (``mlp``, ``resnet``, ``gpt``, ``unet``) has
``build(size="tiny", *, seed=0) -> (module, example_inputs)``: the module in eval mode and a tuple
of example input tensors, both deterministic given ``seed`` (a local ``torch.Generator``; the global
RNG is untouched). Sizes: ``"tiny"`` exports and runs in well under a second (tests); ``"bench"``
takes roughly 5-50 ms per forward on a 2-core CPU (benchmarks). All models export with
``torch.onnx.export(module, inputs, dynamo=True)`` to common ONNX ops.

Example:
    >>> from placement import models
    >>> module, inputs = models.build("mlp")
    >>> module(*inputs).shape
    torch.Size([4, 8])
    >>> sorted(models.MODELS)
    ['gpt', 'mlp', 'resnet', 'unet']
"""

from __future__ import annotations

from types import ModuleType

import torch

from placement.models import gpt, mlp, resnet, unet

__all__ = ["DEFAULT_MODEL", "MODELS", "SIZES", "build", "gpt", "mlp", "resnet", "unet"]

#: Model name -> module with a ``build(size, *, seed)`` function.
MODELS: dict[str, ModuleType] = {"mlp": mlp, "resnet": resnet, "gpt": gpt, "unet": unet}

#: The model examples and the CLI use when none is named.
DEFAULT_MODEL = "gpt"

#: Size names every model accepts.
SIZES: tuple[str, ...] = ("tiny", "bench")


def build(
    name: str, size: str = "tiny", *, seed: int = 0
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Build model ``name`` at ``size``: ``(module in eval mode, example inputs)``.

    Args:
        name: one of :data:`MODELS` (``"mlp"``, ``"resnet"``, ``"gpt"``, ``"unet"``).
        size: ``"tiny"`` or ``"bench"``.
        seed: makes parameters and inputs deterministic.

    Raises:
        ValueError: unknown model name or size (the message lists the known ones).

    Example:
        >>> module, (idx,) = build("gpt", "tiny", seed=0)
        >>> module.lm_head.weight is module.wte.weight
        True
    """
    try:
        model = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
    return model.build(size, seed=seed)
