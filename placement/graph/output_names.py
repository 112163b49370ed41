"""Graph output names from the exported module's output structure, or from the caller.

``pl.from_torch`` names the outputs of a module that returns a dict or a Hugging Face
``ModelOutput`` by its keys (``last_hidden_state``, ``pooler_output``, ``logits``), where the
exporter would call them after its last nodes (``layer_norm_8``, ``tanh``); its
``output_names=`` names them explicitly.

Example:
    >>> import torch
    >>> import placement as pl
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return {"logits": x * 2, "probs": torch.softmax(x, -1)}
    >>> pl.from_torch(Net(), (torch.randn(2, 3),)).outputs
    ['logits', 'probs']
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from placement.errors import ExportError

__all__ = ["rename_outputs", "structure_names"]

log = logging.getLogger(__name__)


def structure_names(call_spec: Any) -> list[str] | None:
    """Output names from the module's output structure (an exported program's ``call_spec``):
    the keys of a dict or a Hugging Face ``ModelOutput`` (``last_hidden_state``,
    ``pooler_output``), nested parts joined by dots (``past_key_values.0.key``); None when no
    output sits under a key (a tensor, a tuple of tensors: the exporter's names stay).

    Example:
        >>> import torch.utils._pytree as pytree
        >>> from types import SimpleNamespace
        >>> _, spec = pytree.tree_flatten({"logits": 0, "hidden": (1, 2)})
        >>> structure_names(SimpleNamespace(out_spec=spec))
        ['logits', 'hidden.0', 'hidden.1']
        >>> structure_names(SimpleNamespace(out_spec=pytree.tree_flatten((0, 1))[1])) is None
        True
    """
    import torch.utils._pytree as pytree

    spec = getattr(call_spec, "out_spec", None)
    if spec is None:
        return None
    try:
        tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        leaves = pytree.tree_flatten_with_path(tree)[0]
    except Exception as err:  # an output structure pytree cannot rebuild: keep the exporter's names
        log.debug("output structure not readable: %s", err)
        return None
    names: list[str] = []
    keyed = False
    for path, _ in leaves:
        parts = []
        for key in path:
            for attr in ("key", "name", "idx"):
                if hasattr(key, attr):
                    parts.append(str(getattr(key, attr)))
                    keyed = keyed or attr != "idx"
                    break
        names.append(".".join(parts))
    return names if keyed and all(names) else None


def rename_outputs(ir_model: Any, names: Sequence[str], *, required: bool) -> None:
    """Rename the graph outputs to ``names`` (in order); a name another value holds, or a count
    that differs, raises ExportError when ``required`` (the caller's ``output_names``), else
    leaves the exporter's names."""
    outputs = list(ir_model.graph.outputs)
    problem = ""
    if len(names) != len(outputs):
        problem = f"{len(names)} output names for {len(outputs)} outputs"
    elif len(set(names)) != len(names):
        problem = f"duplicate output names {sorted(n for n in set(names) if list(names).count(n) > 1)}"
    else:
        inputs = {v.name for v in ir_model.graph.inputs} | set(ir_model.graph.initializers)
        taken = {v.name for node in ir_model.graph for v in node.outputs} | inputs
        own = {v.name for v in outputs}
        for value, name in zip(outputs, names):
            if value.name in inputs:
                problem = f"output {value.name!r} is a graph input or initializer and keeps its name"
            elif name != value.name and name in taken - own:
                problem = f"output name {name!r} is already a blob of the graph"
            if problem:
                break
    if problem:
        if required:
            raise ExportError(f"output_names: {problem}")
        log.debug("outputs keep the exporter's names: %s", problem)
        return
    temporary = [f"__placement_output_{i}" for i in range(len(outputs))]  # swaps are safe
    for value, name in zip(outputs, temporary):
        value.name = name
    for value, name in zip(outputs, names):
        value.name = name
