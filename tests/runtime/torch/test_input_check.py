"""A module from to_torch checks its inputs as Runner does: InputError naming the input, dtype and shape."""

from __future__ import annotations

import pytest
import torch

import placement as pl
from placement.models import mlp


@pytest.fixture(scope="module")
def lowered():
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    return model, pl.to_torch(model, device_map="cpu"), x


def test_right_inputs_run(lowered):
    model, module, x = lowered
    torch.testing.assert_close(
        module(x), torch.from_numpy(pl.run(model, [x.numpy()])[0]), rtol=1e-5, atol=1e-5
    )


def test_rank_one_input_is_refused_not_broadcast(lowered):
    model, module, x = lowered
    name = model.inputs[0]
    with pytest.raises(pl.InputError, match=f"input '{name}' has rank 1, expected 2"):
        module(x[0])


def test_float64_input_is_an_input_error(lowered):
    model, module, x = lowered
    with pytest.raises(pl.InputError, match="has dtype float64, expected float32") as info:
        module(x.double())
    assert model.inputs[0] in str(info.value) and str(list(x.shape)[1]) in str(info.value)


def test_wrong_count_and_non_tensors_are_input_errors(lowered):
    _, module, x = lowered
    with pytest.raises(pl.InputError, match="positional"):
        module(x, x)
    with pytest.raises(pl.InputError, match="expected a torch tensor"):
        module(x.numpy())
    with pytest.raises(pl.InputError, match="missing input"):
        module()


def test_shift_with_no_activations_is_a_placement_error():
    net, (x,) = mlp.build("tiny")
    model = pl.from_torch(net, (x,))
    with pytest.raises(pl.PlacementError, match="activations must be a list"):
        pl.shift_activation_devices(model, None, {0: 1})


def test_int32_token_ids_widen_and_shared_dims_agree():
    """As ``Runner``: int32 ids run as the graph's int64 (by position and by keyword), and inputs
    sharing a symbolic dimension must give it one size (the error names both)."""
    from tests.runtime.test_inputs import _two_inputs

    model = _two_inputs()
    module = pl.to_torch(model, device_map="cpu")
    ids = torch.arange(24, dtype=torch.int32).reshape(2, 12)
    mask = torch.ones(2, 12, dtype=torch.int64)
    want = ids.long() + 1
    got = module(ids, mask)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(module(input_ids=ids, attention_mask=mask.int()), want)
    with pytest.raises(pl.InputError, match="'attention_mask' has size 7 in dimension 1.*'input_ids'"):
        module(ids, torch.ones(2, 7, dtype=torch.int64))
    with pytest.raises(pl.InputError, match="has dtype"):
        module(ids.float(), mask)
