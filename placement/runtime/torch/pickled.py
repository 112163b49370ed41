"""The lowered module's class: a ``GraphModule`` that keeps its behaviour through pickling.

``torch.save``/``torch.load`` (and ``pickle``) rebuild a ``torch.fx.GraphModule`` from
its generated code: a fresh module that keeps its parameters, buffers and plain
attributes, but not its forward hooks, nor its ``meta``. A module from
:func:`placement.to_torch` does its input check (:mod:`.input_check`) and its outputs'
move (:mod:`.outputs`) in forward hooks, so it is a :class:`PlacedGraphModule`,
whose pickle carries the hooks (picklable objects), ``meta`` and the set of its
non-persistent buffers, and puts them back on the rebuilt module, which is a
:class:`PlacedGraphModule` again (a second round trip keeps them too).

Example:
    >>> import io, torch
    >>> import placement as pl
    >>> net = torch.nn.Linear(4, 2)
    >>> module = pl.to_torch(pl.from_torch(net, (torch.randn(3, 4),)), device_map="cpu")
    >>> buffer = io.BytesIO()
    >>> torch.save(module, buffer)
    >>> loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    >>> isinstance(loaded, PlacedGraphModule), loaded.outputs_on
    (True, 'input')
    >>> loaded(torch.randn(4))
    Traceback (most recent call last):
    ...
    placement.errors.InputError: input 'input' has rank 1, expected 2 (expected float32[3, 4], got float32[4])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

__all__ = ["PlacedGraphModule", "FORWARD_HOOKS", "PRESERVED", "ReplayTracer"]

#: ``nn.Module``'s dictionaries of forward hooks (a rebuilt ``GraphModule`` starts without them).
FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
#: What a pickle of a ``GraphModule`` loses: the forward hooks (those this torch has) and
#: the names of its non-persistent buffers.
_KEPT = (*FORWARD_HOOKS, "_non_persistent_buffers_set")

#: ``GraphModule.meta`` key whose attributes ``copy.deepcopy`` (and, here, unpickling) restores.
PRESERVED = getattr(fx.graph_module, "_USER_PRESERVED_ATTRIBUTES_KEY", "_user_preserved_attributes")


class PlacedGraphModule(fx.GraphModule):
    """A ``GraphModule`` whose pickle keeps its forward hooks, ``meta`` and non-persistent
    buffers (see the module docstring); otherwise a ``GraphModule`` like any other."""

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild, args = super().__reduce__()
        if args and isinstance(args[0], dict):  # the module's attributes: replay the code with our tracer
            args[0]["_tracer_cls"] = ReplayTracer
        kept = {key: self.__dict__[key] for key in _KEPT if key in self.__dict__}
        return (_rebuild, (rebuild, args, kept, getattr(self, "meta", {})))


class ReplayTracer(fx.Tracer):
    """Rebuilds a lowered module's graph from its code on unpickling without tracing into the
    lowering's own functions (an op rule reading a dimension, as ``Shape`` does, cannot be
    traced with proxies): each is recorded as the one call it was."""

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        forward = type(root).forward if isinstance(root, torch.nn.Module) else root
        for value in getattr(forward, "__globals__", {}).values():
            if callable(value) and str(getattr(value, "__module__", "")).startswith("placement."):
                getattr(self, "_autowrap_function_ids", set()).add(id(value))
        return super().trace(root, concrete_args)


def _rebuild(
    rebuild: Callable[..., fx.GraphModule], args: tuple[Any, ...], kept: dict[str, Any], meta: dict[str, Any]
) -> PlacedGraphModule:
    """Unpickle: torch rebuilds a plain ``GraphModule`` from the code; it becomes a
    :class:`PlacedGraphModule` sharing its parameters, and gets back what torch dropped."""
    plain = rebuild(*args)
    module = PlacedGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    for key, value in plain.__dict__.items():  # plain attributes torch restored
        if not hasattr(module, key):
            setattr(module, key, value)
    for key, value in kept.items():
        if key == "_non_persistent_buffers_set":
            value = {name for name in value if name in module._buffers}
        object.__setattr__(module, key, value)
    module.meta = meta
    for name, value in meta.get(PRESERVED, {}).items():
        setattr(module, name, value)
    return module
