"""Generation: the decode loop of a placed causal LM over either runtime.

Sits on both runtimes (:mod:`placement.runtime.ort` and :mod:`placement.runtime.torch`):

- :mod:`~placement.generation.prepare`: a decoder-ready copy of a model (last-position
  logits, copies, each layer's KV cache on its layer's device);
- :mod:`~placement.generation.sequences`: tokens, mask, positions, end of sequence;
- :mod:`~placement.generation.sampling`: greedy or sampled next tokens;
- :mod:`~placement.generation.ort_decoder`: steps on ONNX Runtime, caches in device buffers;
- :mod:`~placement.generation.torch_decoder`: steps on the torch runtime, a static cache;
- :mod:`~placement.generation.static_steps`: decode steps on static inputs (CUDA graphs);
- :mod:`~placement.generation.generator`: :class:`Generator` and :func:`generate`.

Example:
    >>> from placement.generation import RUNTIMES
    >>> RUNTIMES
    ('ort', 'torch')
"""

from __future__ import annotations

from placement.generation.generator import RUNTIMES, Generator, generate

__all__ = ["RUNTIMES", "Generator", "generate"]
