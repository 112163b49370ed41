"""Choosing the next token from the last position's logits: greedy or sampled.

:class:`Sampler` holds the options of :func:`placement.generate` (``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``seed``) and its own random generator, so one
seed gives the same tokens on every runtime and placement. Greedy decoding takes the
first index of the largest logit (``numpy.argmax``), as ``torch.argmax`` and
``transformers`` do.

Example:
    >>> import numpy as np
    >>> Sampler().pick(np.array([[0.1, 2.0, 0.3], [5.0, 1.0, 1.0]], np.float32)).tolist()
    [1, 0]
    >>> Sampler(do_sample=True, top_k=1, seed=0).pick(np.array([[0.0, 3.0, 1.0]])).tolist()
    [1]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from placement.errors import InputError

__all__ = ["Sampler"]


@dataclass
class Sampler:
    """Greedy (``do_sample=False``) or sampled choice of the next token per sequence.

    Sampling divides the logits by ``temperature``, keeps the ``top_k`` largest, then the
    smallest set whose probability reaches ``top_p`` (nucleus), and draws from the rest.

    Raises:
        InputError: ``temperature <= 0``, ``top_k < 1`` or ``top_p`` outside ``(0, 1]``.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    rng: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        self.rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> np.ndarray:
        """The next token of each row of ``logits`` ``(batch, vocab)``, as int64."""
        if not self.do_sample:
            return logits.argmax(-1).astype(np.int64)
        scores = logits.astype(np.float64) / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = np.partition(scores, -self.top_k, axis=-1)[:, -self.top_k, None]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        if self.top_p is not None and self.top_p < 1:
            order = np.argsort(-probs, axis=-1, kind="stable")
            sorted_probs = np.take_along_axis(probs, order, -1)
            before = np.cumsum(sorted_probs, -1) - sorted_probs  # mass of the tokens ranked above
            sorted_probs = np.where(before < self.top_p, sorted_probs, 0.0)
            probs = np.zeros_like(probs)
            np.put_along_axis(probs, order, sorted_probs, -1)
            probs /= probs.sum(-1, keepdims=True)
        draws = self.rng.random((probs.shape[0], 1))
        picked = (np.cumsum(probs, -1) < draws).sum(-1)
        return np.minimum(picked, probs.shape[-1] - 1).astype(np.int64)
