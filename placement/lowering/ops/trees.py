"""The ``ai.onnx.ml`` tree ensembles ``TreeEnsembleRegressor`` and ``TreeEnsembleClassifier``,
as ONNX Runtime's CPU kernel computes them.

Every sample walks every tree at once: the node arrays become tensors indexed by a global
node number, and each step moves all (sample, tree) pairs one level down (as many steps as the
deepest tree has levels). A branch goes to its true child where the comparison of the feature
with the node's value holds (``BRANCH_LEQ``, ``BRANCH_LT``, ``BRANCH_GTE``, ``BRANCH_GT``,
``BRANCH_EQ``, ``BRANCH_NEQ``), or where the feature is NaN and the node's
``nodes_missing_value_tracks_true`` is set. A leaf adds its weights to its targets (classes);
trees are aggregated by ``SUM`` (or ``AVERAGE`` for the regressor), ``base_values`` added, and
``post_transform`` ``NONE``, ``LOGISTIC`` or ``SOFTMAX`` applied. The classifier's label is the
first class of the highest score (before the transform), its labels ``classlabels_int64s``.

Refused with :class:`~placement.errors.LoweringError`: ``MIN``/``MAX`` aggregation,
``PROBIT``/``SOFTMAX_ZERO``, string class labels, and a classifier whose weights score fewer
classes than it has labels (ONNX Runtime's binary special case).

Example:
    >>> import torch
    >>> from placement.lowering.ops.trees import tree_ensemble_regressor
    >>> x = torch.tensor([[0.0], [2.0]])
    >>> tree_ensemble_regressor(
    ...     x, nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
    ...     nodes_values=[1.0, 0.0, 0.0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
    ...     nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0], target_treeids=[0, 0],
    ...     target_nodeids=[1, 2], target_ids=[0, 0], target_weights=[-1.0, 1.0]).tolist()
    [[-1.0], [1.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op

_DOMAIN = "ai.onnx.ml"
_MODES = ("LEAF", "BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ")
_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Forest:
    """The node arrays of an ensemble, indexed by global node number."""

    def __init__(self, op_type: str, nodes: dict[str, Sequence[Any]], n_targets: int) -> None:
        self.op_type = op_type
        trees, ids = list(nodes["treeids"]), list(nodes["nodeids"])
        count = len(ids)
        for key, values in nodes.items():
            if values is not None and len(values) != count:
                raise LoweringError(f"{op_type}: nodes_{key} has {len(values)} entries, not {count}")
        self.index = {(t, n): i for i, (t, n) in enumerate(zip(trees, ids))}
        modes = [_text(m) for m in nodes["modes"]]
        unknown = sorted(set(modes) - set(_MODES))
        if unknown:
            raise LoweringError(f"{op_type}: node modes {unknown} are not known")
        self.modes = [_MODES.index(m) for m in modes]
        self.true = [
            self._child(t, c) if m else i
            for i, (t, c, m) in enumerate(zip(trees, nodes["truenodeids"], self.modes))
        ]
        self.false = [
            self._child(t, c) if m else i
            for i, (t, c, m) in enumerate(zip(trees, nodes["falsenodeids"], self.modes))
        ]
        children = {c for i, c in enumerate(self.true + self.false) if self.modes[i % count]}
        self.roots = sorted({trees[i]: i for i in reversed(range(count)) if i not in children}.values())
        self.tree_count = len(set(trees))
        if len(self.roots) != self.tree_count:
            raise LoweringError(f"{op_type}: the nodes do not form {self.tree_count} trees")
        self.depth = self._depth()
        self.features = list(nodes["featureids"])
        self.values = [float(v) for v in nodes["values"]]
        self.missing_true = [bool(v) for v in (nodes.get("missing_value_tracks_true") or [0] * count)]
        self.n_targets = n_targets
        self.leaf_weights = [[0.0] * n_targets for _ in range(count)]

    def _child(self, tree: int, node: int) -> int:
        if (tree, node) not in self.index:
            raise LoweringError(f"{self.op_type}: tree {tree} has no node {node}")
        return self.index[(tree, node)]

    def _depth(self) -> int:
        depth, level = 0, list(self.roots)
        while level:
            level = [c for i in level if self.modes[i] for c in (self.true[i], self.false[i])]
            depth += 1
            if depth > len(self.modes):
                raise LoweringError(f"{self.op_type}: the trees have a cycle")
        return depth

    def add_weights(
        self, treeids: Sequence[int], nodeids: Sequence[int], ids: Sequence[int], weights: Sequence[float]
    ) -> None:
        for t, n, k, w in zip(treeids, nodeids, ids, weights, strict=True):
            if not 0 <= k < self.n_targets:
                raise LoweringError(f"{self.op_type}: target {k} is outside 0..{self.n_targets - 1}")
            self.leaf_weights[self._child(t, n)][k] += float(w)

    def scores(self, X: Tensor) -> Tensor:
        """The per-tree leaf weights summed over trees: ``[N, n_targets]``, float32."""
        x = X.reshape(X.shape[0], -1) if X.dim() != 1 else X.reshape(1, -1)
        device, dtype = x.device, x.dtype if x.dtype.is_floating_point else torch.float32
        x = x.to(dtype)

        def tensor(values: Sequence[Any], kind: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=kind, device=device)

        modes, feats = tensor(self.modes, torch.int64), tensor(self.features, torch.int64)
        values, missing = tensor(self.values, torch.float32).to(dtype), tensor(self.missing_true, torch.bool)
        true, false = tensor(self.true, torch.int64), tensor(self.false, torch.int64)
        node = tensor(self.roots, torch.int64).expand(x.shape[0], -1)
        for _ in range(self.depth):
            v = x.gather(1, feats[node])
            t = values[node]
            m = modes[node]
            cmp = torch.stack([v <= t, v <= t, v < t, v >= t, v > t, v == t, v != t]).gather(
                0, m.unsqueeze(0)
            )[0]
            go = cmp | (torch.isnan(v) & missing[node])
            node = torch.where(m == 0, node, torch.where(go, true[node], false[node]))
        weights = tensor(self.leaf_weights, torch.float32)
        return weights[node].sum(1)


def _nodes(kwargs: dict[str, Any]) -> dict[str, Any]:
    keys = ("treeids", "nodeids", "featureids", "values", "modes", "truenodeids", "falsenodeids")
    missing = [k for k in keys if kwargs.get(k) is None]
    if missing:
        raise LoweringError(f"nodes_{missing[0]} is required")
    return {k: kwargs[k] for k in (*keys, "missing_value_tracks_true")}


def _finish(op_type: str, scores: Tensor, base_values: Sequence[float] | None, post_transform: Any) -> Tensor:
    transform = _text(post_transform)
    if transform not in _TRANSFORMS:
        raise LoweringError(f"{op_type}: post_transform={transform!r} is not supported")
    if base_values:
        scores = scores + torch.tensor(list(base_values), dtype=scores.dtype, device=scores.device)
    if transform == "LOGISTIC":
        return torch.sigmoid(scores)
    return torch.softmax(scores, -1) if transform == "SOFTMAX" else scores


@op("TreeEnsembleRegressor", domain=_DOMAIN)
def tree_ensemble_regressor(
    X: Tensor,
    *,
    aggregate_function: str = "SUM",
    base_values: Sequence[float] | None = None,
    n_targets: int = 1,
    nodes_falsenodeids: Sequence[int] | None = None,
    nodes_featureids: Sequence[int] | None = None,
    nodes_hitrates: Sequence[float] | None = None,
    nodes_missing_value_tracks_true: Sequence[int] | None = None,
    nodes_modes: Sequence[str] | None = None,
    nodes_nodeids: Sequence[int] | None = None,
    nodes_treeids: Sequence[int] | None = None,
    nodes_truenodeids: Sequence[int] | None = None,
    nodes_values: Sequence[float] | None = None,
    post_transform: str = "NONE",
    target_ids: Sequence[int] | None = None,
    target_nodeids: Sequence[int] | None = None,
    target_treeids: Sequence[int] | None = None,
    target_weights: Sequence[float] | None = None,
) -> Tensor:
    """ONNX-ML TreeEnsembleRegressor (see the module docstring): ``[N, n_targets]`` float32."""
    local = {k[6:]: v for k, v in locals().items() if k.startswith("nodes_")}
    aggregate = _text(aggregate_function)
    if aggregate not in ("SUM", "AVERAGE"):
        raise LoweringError(f"TreeEnsembleRegressor: aggregate_function={aggregate!r} is not supported")
    forest = _Forest("TreeEnsembleRegressor", _nodes(local), int(n_targets))
    forest.add_weights(target_treeids or [], target_nodeids or [], target_ids or [], target_weights or [])
    scores = forest.scores(X).float()
    if aggregate == "AVERAGE":
        scores = scores / forest.tree_count
    return _finish("TreeEnsembleRegressor", scores, base_values, post_transform)


@op("TreeEnsembleClassifier", domain=_DOMAIN)
def tree_ensemble_classifier(
    X: Tensor,
    *,
    base_values: Sequence[float] | None = None,
    class_ids: Sequence[int] | None = None,
    class_nodeids: Sequence[int] | None = None,
    class_treeids: Sequence[int] | None = None,
    class_weights: Sequence[float] | None = None,
    classlabels_int64s: Sequence[int] | None = None,
    classlabels_strings: Sequence[str] | None = None,
    nodes_falsenodeids: Sequence[int] | None = None,
    nodes_featureids: Sequence[int] | None = None,
    nodes_hitrates: Sequence[float] | None = None,
    nodes_missing_value_tracks_true: Sequence[int] | None = None,
    nodes_modes: Sequence[str] | None = None,
    nodes_nodeids: Sequence[int] | None = None,
    nodes_treeids: Sequence[int] | None = None,
    nodes_truenodeids: Sequence[int] | None = None,
    nodes_values: Sequence[float] | None = None,
    post_transform: str = "NONE",
    num_outputs: int = 2,
) -> Any:
    """ONNX-ML TreeEnsembleClassifier (see the module docstring): labels ``[N]`` int64 and
    scores ``[N, classes]`` float32."""
    local = {k[6:]: v for k, v in locals().items() if k.startswith("nodes_")}
    if classlabels_strings or not classlabels_int64s:
        raise LoweringError(
            "TreeEnsembleClassifier: only classlabels_int64s are supported (strings are not tensors)"
        )
    labels = list(classlabels_int64s)
    if len(set(class_ids or [])) < len(labels):
        raise LoweringError(
            f"TreeEnsembleClassifier: the weights score {len(set(class_ids or []))} of {len(labels)} classes "
            "(ONNX Runtime's binary special case is not lowered)"
        )
    forest = _Forest("TreeEnsembleClassifier", _nodes(local), len(labels))
    forest.add_weights(class_treeids or [], class_nodeids or [], class_ids or [], class_weights or [])
    raw = forest.scores(X).float()
    if base_values:
        raw = raw + torch.tensor(list(base_values), dtype=raw.dtype, device=raw.device)
    label = torch.tensor(labels, dtype=torch.int64, device=raw.device)[raw.argmax(-1)]
    scores = _finish("TreeEnsembleClassifier", raw, None, post_transform)
    return label if num_outputs == 1 else (label, scores)


__all__ = ["tree_ensemble_classifier", "tree_ensemble_regressor"]
