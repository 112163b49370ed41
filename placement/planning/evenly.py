"""Equal runs of activations per device: the simplest split, and the README's main job.

``place_evenly(model, n)`` cuts the activation list (producer order) into ``n`` runs of
equal length and shifts run ``k`` to ``cuda:k`` with :func:`placement.shift_activation_devices`
(label propagation decides where each op follows), then injects copies. It balances
activation *counts*, not time or memory: use :func:`placement.auto_place` for that.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.place_evenly(pl.from_torch(*mlp.build("tiny")), 2)
    >>> [str(d) for d in model.devices]
    ['cuda:0', 'cuda:1']
"""

from __future__ import annotations

import logging

from placement.errors import PlanError
from placement.graph.device import Device
from placement.graph.model import Model
from placement.passes.activations import get_activation_blobs
from placement.passes.copies import inject_cross_device_copies
from placement.passes.shift import shift_activation_devices

__all__ = ["place_evenly"]

log = logging.getLogger(__name__)


def place_evenly(model: Model, devices: int, *, copies: bool = True) -> Model:
    """Shift the activations into ``devices`` equal runs on ``cuda:0 .. cuda:<devices-1>``.

    The model must sit on one device (``cuda:0``, as :func:`placement.from_torch` leaves
    it). In place, like the passes it calls; the model is returned for chaining.

    Args:
        model: an unplaced :class:`placement.Model`.
        devices: how many logical GPUs (at least 1).
        copies: also run :func:`placement.inject_cross_device_copies`.

    Returns:
        ``model``.

    Raises:
        PlanError: ``devices`` is not a positive int, or the model is already split.

    Example:
        >>> import placement as pl
        >>> from placement.models import gpt
        >>> model = pl.place_evenly(pl.from_torch(*gpt.build("tiny")), 3, copies=False)
        >>> [str(d) for d in model.devices]
        ['cuda:0', 'cuda:1', 'cuda:2']
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices must be a positive int, got {devices!r}")
    present = model.devices
    if len(present) > 1:
        raise PlanError(
            f"place_evenly splits a model on one device; this one uses {[str(d) for d in present]}"
        )
    acts = get_activation_blobs(model)
    if devices > 1 and len(acts) < devices:
        raise PlanError(f"the model has {len(acts)} activations, too few for {devices} devices")
    home = present[0] if present else Device("cuda", 0)
    for k in range(1, devices):  # run k onward moves one device further each time
        source = home if k == 1 else Device("cuda", k - 1)
        shift_activation_devices(model, acts[k * len(acts) // devices :], {source: Device("cuda", k)})
    if copies:
        inject_cross_device_copies(model)
    log.info("place_evenly: %d activations on %d devices", len(acts), devices)
    return model
