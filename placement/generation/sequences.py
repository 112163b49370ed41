"""The host side of a decode loop: tokens, attention mask, positions and end of sequence.

:class:`Sequences` holds one group of sequences being generated: the prompt (left
padded, with its attention mask), the tokens chosen so far and which sequences have
ended. It hands each step's inputs (:meth:`Sequences.prefill`, :meth:`Sequences.decode`)
and takes its logits (:meth:`Sequences.advance`). Position ids count the real tokens
(``cumsum(mask) - 1``, padding at 1, as ``transformers`` does), so a left-padded
sequence decodes as it would alone.

Example:
    >>> import numpy as np
    >>> from placement.generation.sampling import Sampler
    >>> seqs = Sequences(np.array([[0, 7, 8]]), np.array([[0, 1, 1]]), max_new_tokens=2,
    ...                  eos=(), pad=0, sampler=Sampler())
    >>> seqs.prefill()["position_ids"].tolist()
    [[1, 0, 1]]
    >>> seqs.advance(np.array([[0.0, 1.0, 0.0]]))
    >>> seqs.decode()["position_ids"].tolist(), seqs.decode()["attention_mask"].tolist()
    ([[2]], [[0, 1, 1, 1]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from placement.generation.sampling import Sampler

__all__ = ["Sequences"]


class Sequences:
    """One group of sequences decoding together (see the module docstring).

    Args:
        input_ids: ``(batch, prompt)`` int64 prompt, left padded.
        attention_mask: ``(batch, prompt)``, 0 on padding.
        max_new_tokens: tokens to generate per sequence at most.
        eos: end-of-sequence ids (empty: generate exactly ``max_new_tokens``).
        pad: the token given to a sequence after its end.
        sampler: picks each next token.
        on_tokens: called with each step's new tokens ``(batch,)`` (a streamer's ``put``).
    """

    def __init__(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        *,
        max_new_tokens: int,
        eos: Sequence[int],
        pad: int,
        sampler: Sampler,
        on_tokens: Callable[[np.ndarray], Any] | None = None,
    ) -> None:
        self.prompt = input_ids
        self.mask = attention_mask.astype(np.int64)
        self.max_new_tokens = max_new_tokens
        self.eos = np.asarray(list(eos), np.int64)
        self.pad = pad
        self.sampler = sampler
        self.on_tokens = on_tokens
        batch = input_ids.shape[0]
        self.new = np.full((batch, max_new_tokens), pad, np.int64)
        self.count = 0
        self.ended = np.zeros(batch, bool)
        self.next_position = self.mask.sum(-1, keepdims=True).astype(np.int64)

    @property
    def done(self) -> bool:
        """All sequences ended, or ``max_new_tokens`` reached."""
        return self.count >= self.max_new_tokens or bool(self.ended.all())

    def prefill(self) -> dict[str, np.ndarray]:
        """The prompt step's inputs."""
        positions = np.cumsum(self.mask, -1) - 1
        positions[self.mask == 0] = 1
        return {
            "input_ids": np.ascontiguousarray(self.prompt, np.int64),
            "attention_mask": self.mask,
            "position_ids": positions.astype(np.int64),
        }

    def decode(self) -> dict[str, np.ndarray]:
        """The next decode step's inputs (the last chosen token of each sequence)."""
        return {
            "input_ids": self.new[:, self.count - 1 : self.count].copy(),
            "attention_mask": self.mask,
            "position_ids": self.next_position - 1,
        }

    def advance(self, logits: np.ndarray) -> None:
        """Choose each sequence's next token from ``logits`` ``(batch, vocab)``; ended ones get ``pad``."""
        tokens = self.sampler.pick(logits)
        tokens = np.where(self.ended, self.pad, tokens)
        self.new[:, self.count] = tokens
        self.count += 1
        if self.eos.size:
            self.ended |= np.isin(tokens, self.eos)
        self.mask = np.concatenate([self.mask, np.ones((self.mask.shape[0], 1), np.int64)], axis=1)
        self.next_position = self.next_position + 1
        if self.on_tokens is not None:
            self.on_tokens(tokens)

    def result(self) -> np.ndarray:
        """Prompt plus new tokens ``(batch, prompt + generated)``."""
        return np.concatenate([self.prompt, self.new[:, : self.count]], axis=1)
