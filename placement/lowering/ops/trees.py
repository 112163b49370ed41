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
_MODES = (
    "LEAF",
    "BRANCH_LEQ",
    "BRANCH_LT",
    "BRANCH_GTE",
    "BRANCH_GT",
    "BRANCH_EQ",
    "BRANCH_NEQ",
    "BRANCH_MEMBER",
)
_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Forest:
    """The nodes of an ensemble as flat arrays indexed by global node number: mode (an index
    into ``_MODES``, 0 a leaf, 7 set membership), children, feature, value, and per leaf the
    weights of every target."""

    def __init__(
        self,
        op_type: str,
        modes: list[int],
        children: tuple[list[int], list[int]],
        roots: list[int],
        features: list[int],
        values: list[float],
        missing_true: list[bool],
        n_targets: int,
        members: list[list[float]] | None = None,
    ) -> None:
        self.op_type, self.modes, self.roots = op_type, modes, roots
        self.true, self.false = children
        self.features, self.values, self.missing_true = features, values, missing_true
        self.n_targets, self.members = n_targets, members
        self.tree_count = len(roots)
        self.leaf_weights = [[0.0] * n_targets for _ in modes]
        self.depth = self._depth()

    def _depth(self) -> int:
        depth, level = 0, list(self.roots)
        while level:
            level = [c for i in level if self.modes[i] for c in (self.true[i], self.false[i])]
            depth += 1
            if depth > len(self.modes) + 1:
                raise LoweringError(f"{self.op_type}: the trees have a cycle")
        return depth

    def add_weight(self, leaf: int, target: int, weight: float) -> None:
        if not 0 <= target < self.n_targets:
            raise LoweringError(f"{self.op_type}: target {target} is outside 0..{self.n_targets - 1}")
        self.leaf_weights[leaf][target] += float(weight)

    def scores(self, X: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """The per-tree leaf weights summed over trees: ``[N, n_targets]`` in ``dtype``."""
        x = X.reshape(X.shape[0], -1) if X.dim() != 1 else X.reshape(1, -1)
        device = x.device
        x = x.to(x.dtype if x.dtype.is_floating_point else torch.float32)

        def tensor(values: Sequence[Any], kind: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=kind, device=device)

        modes, feats = tensor(self.modes, torch.int64), tensor(self.features, torch.int64)
        values, missing = tensor(self.values, dtype).to(x.dtype), tensor(self.missing_true, torch.bool)
        true, false = tensor(self.true, torch.int64), tensor(self.false, torch.int64)
        sets = None
        if self.members:
            width = max(1, max(len(m) for m in self.members))
            padded = [m + [float("nan")] * (width - len(m)) for m in self.members]
            sets = tensor(padded, dtype).to(x.dtype)
        node = tensor(self.roots, torch.int64).expand(x.shape[0], -1)
        for _ in range(self.depth):
            v = x.gather(1, feats[node])
            t, m = values[node], modes[node]
            member = (v.unsqueeze(-1) == sets[node]).any(-1) if sets is not None else v != v
            tests = torch.stack([v <= t, v <= t, v < t, v >= t, v > t, v == t, v != t, member])
            go = tests.gather(0, m.unsqueeze(0))[0] | (torch.isnan(v) & missing[node])
            node = torch.where(m == 0, node, torch.where(go, true[node], false[node]))
        return tensor(self.leaf_weights, dtype)[node].sum(1)


def _forest_v3(
    op_type: str, nodes: dict[str, Sequence[Any]], n_targets: int
) -> tuple[_Forest, dict[Any, int]]:
    """The forest of opset-3 attributes (nodes named by tree and node id) and that naming."""
    trees, ids = list(nodes["treeids"]), list(nodes["nodeids"])
    count = len(ids)
    for key, values in nodes.items():
        if values is not None and len(values) != count:
            raise LoweringError(f"{op_type}: nodes_{key} has {len(values)} entries, not {count}")
    index = {(t, n): i for i, (t, n) in enumerate(zip(trees, ids))}
    names = [_text(m) for m in nodes["modes"]]
    unknown = sorted(set(names) - set(_MODES[:7]))
    if unknown:
        raise LoweringError(f"{op_type}: node modes {unknown} are not known")
    modes = [_MODES.index(m) for m in names]

    def child(tree: int, node: int) -> int:
        if (tree, node) not in index:
            raise LoweringError(f"{op_type}: tree {tree} has no node {node}")
        return index[(tree, node)]

    true = [child(t, c) if m else i for i, (t, c, m) in enumerate(zip(trees, nodes["truenodeids"], modes))]
    false = [child(t, c) if m else i for i, (t, c, m) in enumerate(zip(trees, nodes["falsenodeids"], modes))]
    children = {c for i in range(count) if modes[i] for c in (true[i], false[i])}
    roots = sorted({trees[i]: i for i in reversed(range(count)) if i not in children}.values())
    if len(roots) != len(set(trees)):
        raise LoweringError(f"{op_type}: the nodes do not form {len(set(trees))} trees")
    missing = [bool(v) for v in (nodes.get("missing_value_tracks_true") or [0] * count)]
    values = [float(v) for v in nodes["values"]]
    forest = _Forest(
        op_type, modes, (true, false), roots, list(nodes["featureids"]), values, missing, n_targets
    )
    return forest, index


def _add_weights(forest: _Forest, index: dict[Any, int], entries: Sequence[Sequence[Any]]) -> None:
    for t, n, k, w in zip(*entries, strict=True):
        if (t, n) not in index:
            raise LoweringError(f"{forest.op_type}: tree {t} has no node {n}")
        forest.add_weight(index[(t, n)], k, w)


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
    forest, index = _forest_v3("TreeEnsembleRegressor", _nodes(local), int(n_targets))
    entries = [target_treeids or [], target_nodeids or [], target_ids or [], target_weights or []]
    _add_weights(forest, index, entries)
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
    forest, index = _forest_v3("TreeEnsembleClassifier", _nodes(local), len(labels))
    entries = [class_treeids or [], class_nodeids or [], class_ids or [], class_weights or []]
    _add_weights(forest, index, entries)
    raw = forest.scores(X).float()
    if base_values:
        raw = raw + torch.tensor(list(base_values), dtype=raw.dtype, device=raw.device)
    label = torch.tensor(labels, dtype=torch.int64, device=raw.device)[raw.argmax(-1)]
    scores = _finish("TreeEnsembleClassifier", raw, None, post_transform)
    return label if num_outputs == 1 else (label, scores)


def _values(value: Any) -> list[Any]:
    if value is None:
        return []
    return value.reshape(-1).tolist() if isinstance(value, torch.Tensor) else list(value)


def _forest_v5(attrs: dict[str, Any], n_targets: int) -> _Forest:
    """The forest of opset-5 attributes: nodes ``0..n-1``, then the leaves."""
    modes = [int(m) + 1 for m in _values(attrs["nodes_modes"])]
    count, leaves = len(modes), len(_values(attrs["leaf_targetids"]))
    if any(not 1 <= m <= 7 for m in modes):
        raise LoweringError("TreeEnsemble: nodes_modes holds a mode outside 0..6")

    def child(ids: str, is_leaf: str) -> list[int]:
        flags = _values(attrs[is_leaf]) or [0] * count
        return [int(c) + (count if f else 0) for c, f in zip(_values(attrs[ids]), flags, strict=True)]

    true, false = (
        child("nodes_truenodeids", "nodes_trueleafs"),
        child("nodes_falsenodeids", "nodes_falseleafs"),
    )
    if any(not 0 <= c < count + leaves for c in true + false):
        raise LoweringError("TreeEnsemble: a child id is outside the nodes and leaves")
    sets: list[list[float]] = [[]]
    for v in _values(attrs.get("membership_values")):
        if v != v:
            sets.append([])
        else:
            sets[-1].append(float(v))
    member_sets = iter(sets)
    members = [next(member_sets, []) if m == 7 else [] for m in modes] + [[] for _ in range(leaves)]
    missing = [bool(v) for v in _values(attrs.get("nodes_missing_value_tracks_true"))] or [False] * count
    forest = _Forest(
        "TreeEnsemble",
        modes + [0] * leaves,
        (true + list(range(count, count + leaves)), false + list(range(count, count + leaves))),
        [int(r) for r in _values(attrs["tree_roots"])],
        [int(f) for f in _values(attrs["nodes_featureids"])] + [0] * leaves,
        [float(v) for v in _values(attrs["nodes_splits"])] + [0.0] * leaves,
        missing + [False] * leaves,
        n_targets,
        members if 7 in modes else None,
    )
    for leaf, (k, w) in enumerate(
        zip(_values(attrs["leaf_targetids"]), _values(attrs["leaf_weights"]), strict=True)
    ):
        forest.add_weight(count + leaf, int(k), w)
    return forest


@op("TreeEnsemble", domain=_DOMAIN)
def tree_ensemble(
    X: Tensor,
    *,
    aggregate_function: int = 1,
    leaf_targetids: Sequence[int] | None = None,
    leaf_weights: Tensor | None = None,
    membership_values: Tensor | None = None,
    n_targets: int | None = None,
    nodes_falseleafs: Sequence[int] | None = None,
    nodes_falsenodeids: Sequence[int] | None = None,
    nodes_featureids: Sequence[int] | None = None,
    nodes_hitrates: Tensor | None = None,
    nodes_missing_value_tracks_true: Sequence[int] | None = None,
    nodes_modes: Tensor | None = None,
    nodes_splits: Tensor | None = None,
    nodes_trueleafs: Sequence[int] | None = None,
    nodes_truenodeids: Sequence[int] | None = None,
    post_transform: int = 0,
    tree_roots: Sequence[int] | None = None,
) -> Tensor:
    """ONNX-ML TreeEnsemble (opset 5; modes ``LEQ, LT, GTE, GT, EQ, NEQ, MEMBER`` as 0-6):
    ``[N, n_targets]`` in ``X``'s type, ``SUM`` or ``AVERAGE`` over trees, no post-transform."""
    attrs = dict(locals())
    required = ("leaf_targetids", "leaf_weights", "n_targets", "nodes_falsenodeids", "nodes_featureids",
                "nodes_modes", "nodes_splits", "nodes_truenodeids", "tree_roots")  # fmt: skip
    absent = [k for k in required if attrs[k] is None]
    if absent:
        raise LoweringError(f"TreeEnsemble: attribute {absent[0]} is required")
    if int(aggregate_function) not in (0, 1):
        raise LoweringError(
            f"TreeEnsemble: aggregate_function={aggregate_function} (MIN/MAX) is not supported"
        )
    if int(post_transform) != 0:  # ONNX names 1 SOFTMAX and 2 LOGISTIC; ORT applies them swapped
        raise LoweringError(
            f"TreeEnsemble: post_transform={post_transform} is not supported (ONNX Runtime and the "
            "ONNX specification disagree on its codes)"
        )
    forest = _forest_v5(attrs, int(n_targets))  # type: ignore[arg-type]
    dtype = X.dtype if X.dtype.is_floating_point else torch.float32
    scores = forest.scores(X, dtype)
    if int(aggregate_function) == 0:
        scores = scores / forest.tree_count
    return scores


__all__ = ["tree_ensemble", "tree_ensemble_classifier", "tree_ensemble_regressor"]
