"""``TfIdfVectorizer`` on integer tokens: n-gram counts (with skips), as TF, IDF or TF-IDF.

For every n-gram length ``n`` in ``[min_gram_length, max_gram_length]`` that the pool
holds, and every skip distance ``d`` in ``1 .. max_skip_count + 1`` (unigrams only once),
the rule counts each pool n-gram among the windows ``x[i], x[i + d], ..., x[i + (n-1) d]``
of each row, adds the count at the n-gram's ``ngram_indexes`` slot, and weighs the counts:
``TF`` as they are, ``IDF`` ``weight`` where the count is positive, ``TFIDF`` ``weight *
count`` (``weights[i]`` is the i-th pool n-gram's, as the specification and ONNX
Runtime say; weights default to 1). Vectorized: one comparison of all windows against all
pool n-grams per length and skip, no values read into Python. String pools are refused.

Example:
    >>> import torch
    >>> from placement.lowering.ops.text import tf_idf_vectorizer
    >>> x = torch.tensor([1, 2, 1, 2, 3])
    >>> tf_idf_vectorizer(x, max_gram_length=2, min_gram_length=1, max_skip_count=0, mode="TF",
    ...                   ngram_counts=[0, 2], ngram_indexes=[0, 1, 2],
    ...                   pool_int64s=[1, 3, 1, 2]).tolist()
    [2.0, 1.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from placement.errors import LoweringError
from placement.lowering.ops._registry import Tensor, op


def _count(rows: Tensor, grams: Tensor, distance: int) -> Tensor:
    """``[rows, grams]`` counts of each n-gram (``grams`` ``[G, n]``) at skip ``distance``."""
    n = grams.shape[1]
    windows = rows.shape[1] - (n - 1) * distance
    if windows <= 0:
        return rows.new_zeros((rows.shape[0], grams.shape[0]))
    starts = torch.arange(windows, device=rows.device).reshape(-1, 1)
    positions = starts + distance * torch.arange(n, device=rows.device).reshape(1, -1)
    picked = rows[:, positions]  # [rows, windows, n]
    match = (picked.unsqueeze(2) == grams.reshape(1, 1, *grams.shape)).all(-1)
    return match.sum(1)


@op("TfIdfVectorizer", foldable=False)
def tf_idf_vectorizer(
    X: Tensor,
    *,
    max_gram_length: int,
    max_skip_count: int,
    min_gram_length: int,
    mode: str,
    ngram_counts: Sequence[int],
    ngram_indexes: Sequence[int],
    pool_int64s: Sequence[int] | None = None,
    pool_strings: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> Tensor:
    """ONNX TfIdfVectorizer on int32/int64 tokens (see the module docstring)."""
    if pool_strings:
        raise LoweringError("TfIdfVectorizer: string pools are not lowered (torch tensors hold no strings)")
    if mode not in ("TF", "IDF", "TFIDF"):
        raise LoweringError(f"TfIdfVectorizer: mode={mode!r} is not TF, IDF or TFIDF")
    if X.dim() > 2:
        raise LoweringError(f"TfIdfVectorizer: input of rank {X.dim()} (expected [C] or [N, C])")
    rows = X.reshape(1, -1) if X.dim() < 2 else X
    rows = rows.to(torch.int64)
    pool = list(pool_int64s or [])
    size = max(ngram_indexes) + 1 if ngram_indexes else 0
    counts = torch.zeros((rows.shape[0], size), dtype=torch.int64, device=X.device)
    starts = list(ngram_counts) + [len(pool)]
    first_id = 0
    for k in range(len(ngram_counts)):
        n = k + 1
        chunk = pool[starts[k] : starts[k + 1]]
        number = len(chunk) // n
        if number and min_gram_length <= n <= max_gram_length:
            grams = torch.tensor(chunk, dtype=torch.int64, device=X.device).reshape(number, n)
            slots = torch.tensor(ngram_indexes[first_id : first_id + number], device=X.device)
            distances = [1] if n == 1 else range(1, max_skip_count + 2)
            for distance in distances:
                found = _count(rows, grams, distance)
                counts = counts.index_add(1, slots, found)
        first_id += number
    weight = None
    if weights:  # the weight of the i-th pool n-gram, at its output slot (as the spec and ORT say)
        weight = torch.zeros(size, dtype=torch.float32, device=X.device)
        weight[torch.tensor(list(ngram_indexes), device=X.device)] = torch.tensor(
            list(weights), dtype=torch.float32, device=X.device
        )
    freq = counts.to(torch.float32)
    if mode == "IDF":
        present = (counts > 0).to(torch.float32)
        out = present * weight if weight is not None else present
    elif mode == "TFIDF" and weight is not None:
        out = freq * weight
    else:
        out = freq
    return out.reshape(size) if X.dim() < 2 else out


__all__ = ["tf_idf_vectorizer"]
