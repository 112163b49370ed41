"""Vision models from torchvision and timm, tried as a new user would.

Each model is built with random weights (nothing downloaded), imported with ``pl.from_torch``,
placed over two logical devices by ``pl.auto_place`` (its default cost: a profile in ONNX
Runtime), run in both runtimes (``pl.run`` and the module ``pl.to_torch`` makes) and must
compute what the torch module computes. Inputs are small: 1x3x64x64 images, a 1x3x4x32x32
clip for ``r3d_18``. The models cover the export paths that failed before: ``as_strided``
(ConvNeXt's and Swin's pooling in torch 2.11's decomposition, once a ``Loop`` over a sequence),
window attention (Swin, Swin v2, CoAtNet), a bias-less ``Conv3d`` (``r3d_18``), and timm's
conv/attention hybrids (EdgeNeXt, CAFormer).

torchvision's wheels need torch's CUDA build from PyPI (their compiled operators do not load
against the pinned CPU torch): the sweep runs in CI's ``gpu-image`` and ``newest``
environments (the ``vision`` extra) and skips, saying why, where torchvision or timm is missing
or unusable. Each model is marked ``slow`` (an export takes seconds).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import placement as pl

TOL = {"rtol": 1e-4, "atol": 1e-5}
IMAGE = (1, 3, 64, 64)
CLIP = (1, 3, 4, 32, 32)  # batch, channels, frames, height, width


def _torchvision():
    """torchvision, or a skip naming why it cannot be used here."""
    try:
        import torchvision
    except Exception as err:  # missing, or built against another torch
        pytest.skip(f"torchvision does not import: {err}")
    try:
        torch.ops.torchvision.nms  # noqa: B018 (its compiled operators, loaded with the package)
    except (AttributeError, RuntimeError) as err:
        pytest.skip(f"torchvision's compiled operators do not load with torch {torch.__version__}: {err}")
    return torchvision


def _timm():
    _torchvision()  # timm builds on torchvision
    try:
        import timm
    except Exception as err:
        pytest.skip(f"timm does not import: {err}")
    return timm


def _tv(name: str, video: bool = False) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        models = _torchvision().models
        return getattr(models.video if video else models, name)(weights=None)

    return build


def _timm_model(name: str, **kwargs: object) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        return _timm().create_model(name, pretrained=False, **kwargs)

    return build


#: name -> (builder, input shape)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "torchvision.convnext_tiny": (_tv("convnext_tiny"), IMAGE),
    "torchvision.swin_t": (_tv("swin_t"), IMAGE),
    "torchvision.swin_v2_t": (_tv("swin_v2_t"), IMAGE),
    "torchvision.video.r3d_18": (_tv("r3d_18", video=True), CLIP),
    "timm.convnext_atto": (_timm_model("convnext_atto"), IMAGE),
    # CoAtNet sizes its attention windows from img_size when built (224 by default): built for 64
    "timm.coatnet_pico_rw_224": (_timm_model("coatnet_pico_rw_224", img_size=IMAGE[-1]), IMAGE),
    "timm.edgenext_xx_small": (_timm_model("edgenext_xx_small"), IMAGE),
    "timm.caformer_s18": (_timm_model("caformer_s18"), IMAGE),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_placed_over_two_devices_equals_the_module(name: str) -> None:
    build, shape = MODELS[name]
    torch.manual_seed(0)  # the library's own random initialisation
    net = build().eval()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = net(x).numpy()

    model = pl.from_torch(net, (x,))
    plan = pl.auto_place(model, devices=2)
    pl.inject_cross_device_copies(model)
    pl.verify(model)
    assert len({op.device for op in model.ops}) == 2, plan

    np.testing.assert_allclose(pl.run(model, [x.numpy()])[0], expected, **TOL)
    module = pl.to_torch(model)
    with torch.no_grad():
        got = module(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    np.testing.assert_allclose(got.cpu().numpy(), expected, **TOL)
