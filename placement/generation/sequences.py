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
        prompt_mask = attention_mask.astype(np.int64)
        self.max_new_tokens = max_new_tokens
        self.eos = np.asarray(list(eos), np.int64)
        self.pad = pad
        self.sampler = sampler
        self.on_tokens = on_tokens
        batch, length = input_ids.shape
        self.count = 0
        self.ended = np.zeros(batch, bool)
        # The buffers a step's inputs are (views of), updated in place: a decode loop binds
        # them once. Row t of ``_tokens`` holds the tokens of step t.
        self._tokens = np.full((max_new_tokens, batch), pad, np.int64)
        self._step_ids = np.zeros((batch, 1), np.int64)
        self._positions = prompt_mask.sum(-1, keepdims=True) - 1
        self._prompt_mask = prompt_mask
        self._padded = not bool(prompt_mask.all())
        self._mask = np.ones(batch * (length + max_new_tokens), np.int64)
        self._step = {
            "input_ids": self._step_ids,
            "attention_mask": prompt_mask,
            "position_ids": self._positions,
        }
        self._greedy = not sampler.do_sample

    @property
    def mask(self) -> np.ndarray:
        """The attention mask of the tokens so far ``(batch, prompt + generated)``."""
        return self._mask_view(self.prompt.shape[1] + self.count)

    @property
    def new(self) -> np.ndarray:
        """The tokens generated so far, ``(batch, generated)``."""
        return self._tokens[: self.count].T

    @property
    def done(self) -> bool:
        """All sequences ended, or ``max_new_tokens`` reached."""
        return self.count >= self.max_new_tokens or bool(self.ended.all())

    def prefill(self) -> dict[str, np.ndarray]:
        """The prompt step's inputs."""
        positions = np.cumsum(self._prompt_mask, -1) - 1
        positions[self._prompt_mask == 0] = 1
        return {
            "input_ids": np.ascontiguousarray(self.prompt, np.int64),
            "attention_mask": self._prompt_mask,
            "position_ids": positions.astype(np.int64),
        }

    def decode(self) -> dict[str, np.ndarray]:
        """The next decode step's inputs (the last chosen token of each sequence).

        The same dict each step, over the same token and position buffers (updated in
        place by :meth:`advance`) and a view of one mask buffer: valid until the next
        :meth:`advance`.
        """
        self._step["attention_mask"] = self._mask_view(self.prompt.shape[1] + self.count)
        return self._step

    def _mask_view(self, length: int) -> np.ndarray:
        """The mask of ``length`` tokens, a contiguous ``(batch, length)`` view of one buffer
        (all ones, but for the prompt's padding, written again for each length)."""
        batch = self._prompt_mask.shape[0]
        view = self._mask[: batch * length].reshape(batch, length)
        if self._padded:
            prompt = self._prompt_mask.shape[1]
            view[:, prompt:] = 1
            view[:, :prompt] = self._prompt_mask
        return view

    def advance(self, logits: np.ndarray) -> None:
        """Choose each sequence's next token from ``logits`` ``(batch, vocab)``; ended ones get ``pad``."""
        row = self._tokens[self.count]
        if self._greedy:
            row[:] = logits.argmax(-1)
        else:
            row[:] = self.sampler.pick(logits)
        if self.eos.size:
            row[self.ended] = self.pad
            self.ended |= np.isin(row, self.eos)
        self._step_ids[:, 0] = row
        self._positions += 1
        self.count += 1
        if self.on_tokens is not None:
            self.on_tokens(row.copy())

    def result(self) -> np.ndarray:
        """Prompt plus new tokens ``(batch, prompt + generated)``."""
        return np.concatenate([self.prompt, self._tokens[: self.count].T], axis=1)
