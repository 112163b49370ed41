"""The model zoo: every tiny model builds, exports with the dynamo exporter and runs in ORT."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from placement import models
from placement.models import gpt, resnet, unet

NAMES = sorted(models.MODELS)

#: Output shape of each tiny model.
TINY_OUTPUT_SHAPES = {
    "mlp": (4, 8),
    "resnet": (2, 10),
    "gpt": (2, 8, 64),
    "unet": (2, 2, 16, 16),
}

#: Ops the zoo may export to: common ones every runtime and the torch lowering table handle.
COMMON_OPS = {
    "Add", "BatchNormalization", "Concat", "Conv", "ConvTranspose", "Gather", "Gelu", "Gemm",
    "InstanceNormalization", "LayerNormalization", "MatMul", "MaxPool", "Mul", "ReduceMean",
    "Relu", "Reshape", "Resize", "Softmax", "Split", "Transpose", "Where",
}  # fmt: skip


def _export_and_run(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[ir.Model, list]:
    program = torch.onnx.export(module, args, dynamo=True, verbose=False)
    model = program.model
    model.ir_version = min(model.ir_version, 10)  # ONNX Runtime here reads IR <= 13 only
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {inp.name: arg.numpy() for inp, arg in zip(session.get_inputs(), args, strict=True)}
    return model, session.run(None, feeds)


def _check_export(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> ir.Model:
    with torch.no_grad():
        expected = module(*args)
    model, (actual,) = _export_and_run(module, args)
    np.testing.assert_allclose(actual, expected.numpy(), rtol=1e-4, atol=1e-4)
    op_types = {node.op_type for node in model.graph}
    assert op_types <= COMMON_OPS, f"uncommon ops exported: {sorted(op_types - COMMON_OPS)}"
    return model


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_exports_and_matches_onnxruntime(name: str) -> None:
    module, args = models.build(name, "tiny")
    assert not module.training and not any(m.training for m in module.modules())
    assert args[0].shape[0] > 1, "tiny batch sizes must be > 1"
    with torch.no_grad():
        assert tuple(module(*args).shape) == TINY_OUTPUT_SHAPES[name]
    _check_export(module, args)


def test_unet_nearest_upsampling_exports_to_resize() -> None:
    module = unet.UNet((4, 8), in_channels=3, out_channels=2, upsample="nearest")
    module.reset_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = _check_export(module.eval(), (x,))
    assert "Resize" in {node.op_type for node in model.graph}


def test_unknown_model_is_a_value_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'alexnet'") as info:
        models.build("alexnet")
    for name in NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_size_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="'huge'.*bench.*tiny"):
        models.build(name, "huge")


def test_registry() -> None:
    assert set(models.MODELS) == {"mlp", "resnet", "gpt", "unet"}
    assert models.DEFAULT_MODEL in models.MODELS
    for name in models.__all__:
        assert hasattr(models, name)


@pytest.mark.parametrize("name", NAMES)
def test_build_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    rng = torch.get_rng_state()
    module_a, args_a = models.build(name, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(12345)  # the global RNG must not matter
    module_b, args_b = models.build(name, seed=3)
    module_c, args_c = models.build(name, seed=4)
    state_a, state_b, state_c = module_a.state_dict(), module_b.state_dict(), module_c.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(a, b) for a, b in zip(args_a, args_b, strict=True))
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    assert not all(torch.equal(a, c) for a, c in zip(args_a, args_c, strict=True))


def test_gpt_lm_head_is_tied_to_token_embedding() -> None:
    module, _ = gpt.build("tiny")
    assert module.lm_head.weight is module.wte.weight
    assert module.lm_head.bias is None
    names = dict(module.named_parameters())  # a tied parameter is listed once
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert {"wpe.weight", "blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_fc.weight"} <= set(names)
    assert {"ln_f", "lm_head", "blocks.0", "blocks.1"} <= dict(module.named_modules()).keys()


def test_gpt_attention_is_causal() -> None:
    module, (idx,) = gpt.build("tiny")
    changed = idx.clone()
    changed[:, -1] = (idx[:, -1] + 1) % module.config.vocab_size
    with torch.no_grad():
        before, after = module(idx), module(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_resnet_has_torchvision_names_and_projection_shortcuts() -> None:
    module, _ = resnet.build("tiny")
    names = dict(module.named_modules())
    assert {"conv1", "bn1", "layer1", "layer2", "avgpool", "fc"} <= names.keys()
    assert module.layer1[0].downsample is None
    assert isinstance(module.layer2[0].downsample[1], torch.nn.BatchNorm2d)
    assert module.layer2[0].conv1.stride == (2, 2)


@pytest.mark.parametrize("name", NAMES)
def test_bench_size_builds(name: str) -> None:
    module, args = models.build(name, "bench")
    tiny, _ = models.build(name, "tiny")
    n_bench = sum(p.numel() for p in module.parameters())
    n_tiny = sum(p.numel() for p in tiny.parameters())
    assert n_bench > 10 * n_tiny
    assert not module.training
    assert all(isinstance(a, torch.Tensor) for a in args) and args[0].shape[0] > 1
