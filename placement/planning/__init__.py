"""Deciding where ops go: the seed systems' front-ends, the profiler and the planner.

- :mod:`~placement.planning.modules`: module path -> device maps (modelsplit).
- :mod:`~placement.planning.experts`: ``spread_experts``, mixture-of-experts layers over devices.
- :mod:`~placement.planning.blocks`: ``begin_block`` (poptorch's BeginBlock).
- :mod:`~placement.planning.stage_assignment`: per-op stage lists (Keras IPU).
- :mod:`~placement.planning.balance`: torchgpipe balance lists, by time or size.
- :mod:`~placement.planning.evenly`: ``place_evenly``, equal runs of activations per device.
- :mod:`~placement.planning.frontend`: what the front-ends share (transactions, neighbours).
- :mod:`~placement.planning.profile`: per-op ONNX Runtime times, bytes, FLOPs, liveness.
- :mod:`~placement.planning.planner`: ``auto_place``, the exact planner's front door;
  :mod:`~placement.planning.partition`: the partition problem it solves;
  :mod:`~placement.planning.plan`: the ``Plan`` it returns (table, JSON, files).
- :mod:`~placement.planning.predict`: ``predict``, a plan's step time and speed-up on N devices
  from measured stage times and a link model (pipeline bubbles, transfer overlap).

Every front-end only sets op devices, in place and transactionally; copies come after.

May import: ``placement.errors``, ``placement.graph``, ``placement.analysis``, ``placement.passes``.

Example:
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> pl.balance(model, [2, 3])
    >>> sorted(str(d) for d in model.devices)
    ['cuda:0', 'cuda:1']
"""

from __future__ import annotations

from placement.planning.balance import balance, balance_by_size, balance_by_time
from placement.planning.blocks import begin_block
from placement.planning.evenly import place_evenly
from placement.planning.experts import expert_modules, spread_experts
from placement.planning.modules import assign_modules, module_devices
from placement.planning.plan import Plan
from placement.planning.planner import auto_place
from placement.planning.profile import Profile, profile
from placement.planning.stage_assignment import (
    StageAssignment,
    get_stage_assignment,
    set_stage_assignment,
)

__all__ = [
    "balance",
    "balance_by_size",
    "balance_by_time",
    "begin_block",
    "place_evenly",
    "assign_modules",
    "module_devices",
    "expert_modules",
    "spread_experts",
    "Plan",
    "auto_place",
    "Profile",
    "profile",
    "StageAssignment",
    "get_stage_assignment",
    "set_stage_assignment",
]
