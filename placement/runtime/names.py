"""Names a caller gives checked against the names a model has: none unknown, none missing.

Both runtimes take dicts keyed by the model's names (inputs by graph-input name, device maps
by logical device); :func:`check_names` raises the error that names the offenders either way.

Example:
    >>> from placement.errors import InputError
    >>> check_names(["x"], ["x"], error=InputError, unknown="unknown input {names}", missing="")
    >>> check_names(["y"], ["x"], error=InputError, unknown="unknown input {names}; have {expected}",
    ...             missing="missing input {names}")
    Traceback (most recent call last):
    ...
    placement.errors.InputError: unknown input 'y'; have 'x'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from placement.errors import PlacementError

__all__ = ["check_names"]


def check_names(
    given: Iterable[Any],
    expected: Sequence[Any],
    *,
    error: type[PlacementError],
    unknown: str,
    missing: str,
    show: Callable[[Any], str] = repr,
) -> None:
    """Raise ``error`` if ``given`` holds a name not in ``expected``, or lacks one of ``expected``.

    Unknown names are reported first, in ``given``'s order; missing ones in ``expected``'s order.

    Args:
        given: the names the caller gave.
        expected: the names the model has.
        error: the :class:`~placement.errors.PlacementError` subclass to raise.
        unknown, missing: the messages, formatted with ``names`` (the offenders) and
            ``expected`` (every expected name), each a comma-separated list of ``show(name)``.
        show: how a name is written in the message (default ``repr``).
    """
    given = list(given)
    expected_set = set(expected)
    listed = ", ".join(map(show, expected))
    extra = [name for name in given if name not in expected_set]
    if extra:
        raise error(unknown.format(names=", ".join(map(show, extra)), expected=listed))
    present = set(given)
    absent = [name for name in expected if name not in present]
    if absent:
        raise error(missing.format(names=", ".join(map(show, absent)), expected=listed))
