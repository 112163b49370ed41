"""split_tensor_parallel on the zoo: exactness, collectives, shards, invariants, errors."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx_ir as ir
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import placement as pl
from placement.graph.nodes import COLLECTIVE_KEY, TP_KEY, collective_tag
from placement.models import gpt, mlp, resnet

TOL = {"rtol": 1e-5, "atol": 1e-5}


@functools.cache
def _zoo(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], pl.Model]:
    module, args = {"mlp": mlp, "gpt": gpt, "resnet": resnet}[name].build("tiny")
    return module, args, pl.from_torch(module, args)


def _built(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], pl.Model]:
    """A zoo model, its inputs and a fresh copy of its export (exported once per module)."""
    module, args, model = _zoo(name)
    return module, args, model.copy()


def _split(
    module: nn.Module, args: tuple[torch.Tensor, ...], devices: list[int], model: pl.Model | None = None
) -> tuple[pl.Model, np.ndarray]:
    model = pl.from_torch(module, args) if model is None else model
    with torch.no_grad():
        expected = module(*args).numpy()
    pl.split_tensor_parallel(model, devices=devices)
    pl.verify(model)
    return model, expected


def _feeds(model: pl.Model, args: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    return {name: a.numpy() for name, a in zip(model.inputs, args)}


def _collectives(model: pl.Model, kind: str) -> list[ir.Node]:
    return [n for n in model.graph if (tag := collective_tag(n)) is not None and tag["kind"] == kind]


@pytest.mark.parametrize("zoo", ["mlp", "gpt", "resnet"])
def test_zoo_split_equals_the_original(zoo) -> None:
    module, args, model = _built(zoo)
    model, expected = _split(module, args, [0, 1], model)
    assert {str(d) for d in model.devices} == {"cuda:0", "cuda:1"}
    np.testing.assert_allclose(pl.run(model, _feeds(model, args))[0], expected, **TOL)
    lowered = pl.to_torch(model)
    with torch.no_grad():
        out = lowered(*args)
    np.testing.assert_allclose(out.numpy(), expected, **TOL)


def test_two_all_reduces_per_transformer_block() -> None:
    module, args, model = _built("gpt")
    model, _ = _split(module, args, [0, 1], model)
    per_block: dict[str, set[int]] = {}
    for node in _collectives(model, "all_reduce"):
        scope = pl.Op(node).scope or ""
        if scope.startswith("blocks."):
            per_block.setdefault(".".join(scope.split(".")[:2]), set()).add(collective_tag(node)["id"])
    assert {block: len(ids) for block, ids in per_block.items()} == {"blocks.0": 2, "blocks.1": 2}
    # each all-reduce is one Sum per device, of every device's partial in device order
    for node in _collectives(model, "all_reduce"):
        assert node.op_type == "Sum" and len(node.inputs) == 2
        sources = [
            pl.Op(v.producer()).device
            if not pl.Op(v.producer()).is_copy
            else pl.Op(v.producer().inputs[0].producer()).device
            for v in node.inputs
        ]
        assert [str(d) for d in sources] == ["cuda:0", "cuda:1"]


def test_a_dynamic_batch_export_splits_heads_as_a_static_one() -> None:
    """Reshapes whose leading dim is the symbolic batch still split attention by whole heads
    (the dims before the split axis match by the symbol's name): the same collectives as the
    static export, not an all-gather around each attention."""
    module, args = gpt.build("tiny")
    model = pl.from_torch(module, args, dynamic_shapes=tuple({0: torch.export.Dim("batch")} for _ in args))
    result = pl.split_tensor_parallel(model, devices=[0, 1])
    static = pl.split_tensor_parallel(_built("gpt")[2], devices=[0, 1])
    assert (result.all_reduces, result.all_gathers) == (static.all_reduces, static.all_gathers) == (5, 1)
    batch = torch.cat([args[0]] * 3)
    with torch.no_grad():
        expected = module(batch).numpy()
    np.testing.assert_allclose(pl.run(model, _feeds(model, (batch,)))[0], expected, **TOL)


def test_replicas_of_an_all_reduce_are_bitwise_equal() -> None:
    module, args, model = _built("mlp")
    pl.split_tensor_parallel(model, devices=[0, 1])
    sums = [n.outputs[0].name for n in _collectives(model, "all_reduce")]
    assert len(sums) == 2
    probe = model.copy()
    probe.graph.outputs.extend(probe.value(name) for name in sums)
    pl.inject_cross_device_copies(probe)
    outs = pl.run(probe, _feeds(probe, args), device_map="cpu")
    np.testing.assert_array_equal(outs[-2], outs[-1])


def test_tied_embedding_and_lm_head_share_their_shards() -> None:
    module, args, model = _built("gpt")
    model, _ = _split(module, args, [0, 1], model)
    params = model.parameters
    assert "lm_head.weight" not in params  # only its shards remain
    shards = sorted(name for name in params if name.startswith("lm_head.weight.tp"))
    assert shards == ["lm_head.weight.tp0", "lm_head.weight.tp1"]
    readers = {name: sorted({u.node.op_type for u in model.value(name).uses()}) for name in shards}
    assert all("Gather" in ops for ops in readers.values())
    assert len(_collectives(model, "all_gather")) >= 1  # the vocab-parallel logits


def test_each_device_holds_a_share_of_the_split_weights() -> None:
    module, args, model = _built("gpt")
    full = model.parameters
    model, _ = _split(module, args, [0, 1], model.copy())
    by_device: dict[str, int] = {}
    for name, param in model.parameters.items():
        if ".tp" in name:
            by_device[str(param.device)] = by_device.get(str(param.device), 0) + param.nbytes
    split_bytes = sum(p.nbytes for n, p in full.items() if not model.has_blob(n))
    assert set(by_device) == {"cuda:0", "cuda:1"}
    for nbytes in by_device.values():
        assert nbytes <= split_bytes / 2 + 1024  # biases and small shards: at most half, plus slack


def test_summary_shows_collectives_and_their_bytes() -> None:
    module, args, model = _built("gpt")
    model, _ = _split(module, args, [0, 1], model)
    report = pl.summary(model)
    first = report.row(0)
    assert first.collectives == 6  # 5 all-reduces and the logits' all-gather
    assert first.collective_bytes > 0 and not report.unknown_sizes
    column = next(c for c in report.columns if c.header == "collectives")
    assert column.get(first).startswith("6 (")


def test_save_and_load_round_trip(tmp_path) -> None:
    module, args, model = _built("gpt")
    model, expected = _split(module, args, [0, 1], model)
    model.save(tmp_path / "tp.onnx")
    loaded = pl.load(tmp_path / "tp.onnx")
    pl.verify(loaded)
    before = sorted(
        (n.name, n.metadata_props[COLLECTIVE_KEY]) for n in model.graph if COLLECTIVE_KEY in n.metadata_props
    )
    after = sorted(
        (n.name, n.metadata_props[COLLECTIVE_KEY]) for n in loaded.graph if COLLECTIVE_KEY in n.metadata_props
    )
    assert before == after and before
    assert json.loads(before[0][1])["group"] == ["cuda:0", "cuda:1"]
    np.testing.assert_allclose(pl.run(loaded, _feeds(loaded, args))[0], expected, **TOL)


def test_verify_catches_a_partial_read_by_an_op() -> None:
    module, args, model = _built("mlp")
    pl.split_tensor_parallel(model, devices=[0, 1])
    partial = next(n for n in model.graph if n.metadata_props.get(TP_KEY) == "partial")
    relu = ir.Node(
        "",
        "Relu",
        [partial.outputs[0]],
        name="sneak",
        metadata_props={"placement.device": str(pl.Op(partial).device)},
    )
    model.graph.insert_after(partial, relu)
    with pytest.raises(pl.VerificationError, match="not by an all-reduce"):
        pl.verify(model)


def test_verify_catches_a_shard_at_a_graph_output() -> None:
    module, args, model = _built("mlp")
    pl.split_tensor_parallel(model, devices=[0, 1])
    shard = next(n for n in model.graph if n.metadata_props.get(TP_KEY) == "shard")
    model.graph.outputs.append(shard.outputs[0])
    with pytest.raises(pl.VerificationError, match="reaches a graph output"):
        pl.verify(model)


def test_ragged_heads_over_three_devices() -> None:
    torch.manual_seed(0)
    module = gpt.GPT(gpt.GPTConfig(n_head=4, d_model=32))  # 4 heads over 3 devices: 2, 1, 1
    idx = torch.randint(0, 64, (2, 8))
    model, expected = _split(module.eval(), (idx,), [0, 1, 2])
    np.testing.assert_allclose(pl.run(model, {"idx": idx.numpy()}, device_map="cpu")[0], expected, **TOL)


@pytest.mark.parametrize(
    ("devices", "match"),
    [([0], "at least two"), ([0, 0], "distinct"), ("cuda:0", "list"), ([0, "gpu:x"], "devices")],
)
def test_bad_groups_raise(devices, match) -> None:
    model = _built("mlp")[2]
    with pytest.raises(pl.InputError, match=match):
        pl.split_tensor_parallel(model, devices=devices)


def test_heads_the_degree_cannot_spread_raise_and_leave_the_model_unchanged() -> None:
    module, args, model = _built("gpt")  # 2 heads
    before = model.ir_model
    names = [op.name for op in model.ops]
    named = r"op '[^']+' \((MatMul|Gemm)\): 2 heads cannot be spread over 3 devices"
    with pytest.raises(pl.InputError, match=named):
        pl.split_tensor_parallel(model, devices=[0, 1, 2])
    assert model.ir_model is before and [op.name for op in model.ops] == names
    assert model.devices == [pl.Device("cuda", 0)]


def test_placed_models_and_empty_scopes_raise() -> None:
    module, args, model = _built("mlp")
    model.set_device(model.ops[-1].name, 1)
    with pytest.raises(pl.InputError, match="on one device"):
        pl.split_tensor_parallel(model, devices=[0, 1])
    model = _built("mlp")[2]
    with pytest.raises(pl.InputError, match="no op could be split"):
        pl.split_tensor_parallel(model, devices=[0, 1], scopes=["nothing.here"])


def test_scopes_limit_the_split() -> None:
    module, args, model = _built("gpt")
    expected = module(*args).detach().numpy()
    result = pl.split_tensor_parallel(model, devices=[0, 1], scopes=["blocks.1.mlp"])
    assert len(result.split) == 2 and result.all_reduces == 1
    np.testing.assert_allclose(pl.run(model, _feeds(model, args))[0], expected, **TOL)


class _Mlp(nn.Module):
    def __init__(self, d: int, ff: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.up = nn.Linear(d, ff)
        self.gate = nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.act == "swiglu":
            h = nn.functional.silu(self.gate(x)) * h
        else:
            h = {"relu": torch.relu, "gelu": nn.functional.gelu, "silu": nn.functional.silu}[self.act](h)
        return self.down(h) + x


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d=st.integers(2, 12),
    ff=st.integers(4, 24),
    degree=st.integers(2, 4),
    act=st.sampled_from(["relu", "gelu", "silu", "swiglu"]),
)
def test_random_mlps_split_exactly(d: int, ff: int, degree: int, act: str) -> None:
    torch.manual_seed(d * 100 + ff)
    module = _Mlp(d, ff, act).eval()
    x = torch.randn(3, 5, d)
    model, expected = _split(module, (x,), list(range(degree)))
    # invariants: one all-reduce (the down projection); shards of every split weight cover it
    assert len({collective_tag(n)["id"] for n in _collectives(model, "all_reduce")}) == 1
    shards = [p for name, p in model.parameters.items() if name.startswith("up.weight.tp")]
    assert len(shards) == degree and sum(p.shape[0] for p in shards) == ff
    assert max(p.shape[0] for p in shards) - min(p.shape[0] for p in shards) <= 1  # ragged by at most one
    out = pl.run(model, {model.inputs[0]: x.numpy()}, device_map="cpu")[0]
    np.testing.assert_allclose(out, expected, **TOL)


def test_training_gives_the_unsplit_gradients() -> None:
    torch.manual_seed(0)
    module = _Mlp(8, 16, "gelu")
    x = torch.randn(4, 8)
    model = pl.from_torch(module, (x,))
    pl.split_tensor_parallel(model, devices=[0, 1])
    lowered = pl.to_torch(model)
    module(x).square().sum().backward()
    lowered(x).square().sum().backward()
    grads = {name: p.grad for name, p in lowered.named_parameters()}
    paths = lowered.initializer_paths

    def grad(name: str) -> torch.Tensor:
        return grads[paths[name]]

    # column parallel: output rows of up.weight; row parallel: input columns of down.weight
    torch.testing.assert_close(
        torch.cat([grad("up.weight.tp0"), grad("up.weight.tp1")], 0), module.up.weight.grad
    )
    torch.testing.assert_close(torch.cat([grad("up.bias.tp0"), grad("up.bias.tp1")], 0), module.up.bias.grad)
    down = [n for n in paths if n.startswith("down.weight.tp")]
    torch.testing.assert_close(torch.cat([grad(n) for n in sorted(down)], 1), module.down.weight.grad)
    torch.testing.assert_close(grad("down.bias"), module.down.bias.grad)


class _GroupedConvs(nn.Module):
    """A column conv, then a depthwise and a grouped conv on its channel shards, then a row conv."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 8, 1)
        self.depthwise = nn.Conv2d(8, 16, 3, padding=1, groups=8)
        self.grouped = nn.Conv2d(16, 8, 3, padding=1, groups=4)
        self.out = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.depthwise(h))
        return self.out(torch.relu(self.grouped(h)))


@pytest.mark.parametrize("degree", [2, 4])
def test_grouped_and_depthwise_convs_split_by_groups(degree: int) -> None:
    torch.manual_seed(0)
    module, args = _GroupedConvs().eval(), (torch.randn(2, 3, 6, 6),)
    model, expected = _split(module, args, list(range(degree)))
    convs = [n for n in model.graph if n.op_type == "Conv"]
    groups = {n.attributes["group"].value for n in convs if "group" in n.attributes}
    assert groups - {1} == {8 // degree, 4 // degree} - {1}  # each device convolves its own groups
    assert len(_collectives(model, "all_reduce")) == 1  # only after the last (row) conv
    got = pl.run(model, _feeds(model, args), device_map="cpu")[0]
    np.testing.assert_allclose(got, expected, **TOL)
