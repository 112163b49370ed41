"""Names of KV cache values in the convention of ONNX Runtime's ecosystem.

Graphs with a KV cache (from :func:`placement.from_causal_lm`, onnxruntime-genai or optimum)
take ``past_key_values.{i}.key`` / ``past_key_values.{i}.value`` inputs and give
``present.{i}.key`` / ``present.{i}.value`` outputs. A cache is state, not an activation:
the passes feed a past input on the device of its readers and leave a present output on
the device that produced it (never copied to the graph's input or output device).

Example:
    >>> is_cache_input(past_name(0, "key")), is_cache_output(present_name(0, "value"))
    (True, True)
"""

from __future__ import annotations

import re

__all__ = ["PAST", "PRESENT", "is_cache_input", "is_cache_output", "past_name", "present_name"]

#: A name may end in ``.tp{d}``: device ``d``'s heads of a cache split on its head axis
#: (decode loops of tensor-parallel models keep one cache per device, see
#: :mod:`placement.passes.tensor_parallel.kv_shards`).
PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)(?:\.tp\d+)?$")
PRESENT = re.compile(r"^present\.(\d+)\.(key|value)(?:\.tp\d+)?$")


def past_name(layer: int, kind: str) -> str:
    """``past_key_values.{layer}.{kind}`` (``kind``: ``"key"`` or ``"value"``).

    Example:
        >>> past_name(3, "value")
        'past_key_values.3.value'
    """
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """``present.{layer}.{kind}``.

    Example:
        >>> present_name(0, "key")
        'present.0.key'
    """
    return f"present.{layer}.{kind}"


def is_cache_input(name: str | None) -> bool:
    """Whether a graph input name is a past KV cache tensor (``past_key_values.{i}.key/value``).

    Example:
        >>> is_cache_input("past_key_values.0.key"), is_cache_input("input_ids")
        (True, False)
    """
    return name is not None and PAST.match(name) is not None


def is_cache_output(name: str | None) -> bool:
    """Whether a graph output name is a present KV cache tensor (``present.{i}.key/value``).

    Example:
        >>> is_cache_output("present.2.value"), is_cache_output("logits")
        (True, False)
    """
    return name is not None and PRESENT.match(name) is not None
