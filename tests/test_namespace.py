"""``import placement as pl``: ``dir(pl)`` lists the public API and the subpackages, not the tools
``placement/__init__.py`` imports for itself; every listed name resolves."""

from __future__ import annotations

import placement as pl


def test_dir_shows_the_public_names_only():
    names = [n for n in dir(pl) if not n.startswith("__")]
    for tool in ("Any", "TYPE_CHECKING", "annotations", "importlib"):
        assert tool not in names
    assert set(pl.__all__) <= set(names)
    assert all(not n.startswith("_") for n in names)
    for name in ("auto_place", "Runner", "summary", "planning"):
        assert name in names and getattr(pl, name) is not None
