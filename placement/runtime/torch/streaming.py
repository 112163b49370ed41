"""Streamed weights in the torch lowering: host-resident parameters copied to the GPU every forward.

A ``streamed`` copy (see :func:`placement.stream_parameters`) lowers to a call of the
module's :class:`WeightStreamer` (``self.weight_streamer(h_3_mlp_c_fc_weight, index=7)``),
and the last reader of the copy is followed by ``self.weight_release(linear_3, index=7)``
(:mod:`.stream_release`). The streamer decides which weight is copied when and where; a
copy engine (:mod:`.copy_engine`) carries it out. The schedule is correct by construction:

* **the window** is one device buffer per device (``placement.stream_window`` bytes; unset:
  twice the largest weight, double-buffering), laid out as a ring in first-use order: the
  streamed weights in use and those copied ahead live there and nowhere else, so the GPU
  memory they take is the window, whatever the caching allocator does;
* **a read waits for its copy**: handing out weight ``k`` makes the consuming stream wait
  for the event recorded after ``k``'s copy (``wait_event`` on a GPU);
* **a refill waits for the last reader**: ``weight_release`` records an event on the
  compute stream behind the last reader of ``k``; a copy into ``k``'s region is issued only
  after that release (host side) and its copy stream waits for that event (device side);
* **prefetch**: handing out or releasing a weight starts the copies of the next weights in
  first-use order (wrapping round to the first for the next forward) while their regions of
  the ring are free, so the next streamed layer's copy runs under the current compute.

A weight read with autograd on (training) is copied to a fresh tensor instead (the
backward reads it after the forward; the caching allocator keeps it, ``record_stream``\\ ed
on the compute stream). A weight requested while its region is still in use (another
micro-batch of a pipeline) is also copied to a fresh tensor, counted in ``overflow``.

On the CPU the default engine copies nothing (``.to`` of a host tensor to the host);
:meth:`WeightStreamer.use` installs another engine, e.g. the emulated one of
:mod:`.copy_emulation`, under which the same schedule runs with late, out-of-order,
poisoned copies. ``streamer.timing = True`` times every copy on a GPU (CUDA events);
:meth:`WeightStreamer.copy_seconds` sums them.

Example:
    >>> import torch
    >>> from placement.runtime.torch.copy_emulation import EmulatedCopyEngine
    >>> weights = [torch.full((4,), float(i)) for i in range(3)]
    >>> streamer = WeightStreamer([("cpu", 16)] * 3, window=1024)  # two 512-byte regions
    >>> streamer.bind(weights)
    >>> engine = streamer.use(EmulatedCopyEngine())
    >>> got = []
    >>> with torch.no_grad():
    ...     for k, w in enumerate(weights):
    ...         got.append(streamer(w, index=k)[0].item())   # waits for the copy of weight k
    ...         streamer.release(k)                           # its last reader is queued
    >>> got
    [0.0, 1.0, 2.0]
    >>> streamer.prefetched > 0, streamer.overflow
    (True, 0)
    >>> engine.close()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from placement.lowering.emit import STREAMER_NAME
from placement.planning.offload_layers import ALIGN, aligned
from placement.runtime.torch.copy_engine import CudaCopyEngine, DirectEngine, engine_for

__all__ = [
    "WeightStreamer",
    "STREAMER_NAME",
    "ALIGN",
    "pin_streamed",
    "pin_arena",
    "measure_workspace",
    "free_workspaces",
]

log = logging.getLogger(__name__)

#: Test-only hazards (``streamer._unsafe``): drop one order to prove the tests see it. ``skip_wait``:
#: a read does not wait for its copy's event; ``skip_release``: a refill does not wait for its
#: region's last reader; ``skip_keep``: a fresh copy is not ``record_stream``-ed on the compute
#: stream; ``skip_window_keep``: the window is not ``record_stream``-ed on the copy stream.
HAZARDS = ("skip_wait", "skip_release", "skip_keep", "skip_window_keep")


@dataclass
class _Slot:
    """A weight's region of the window: copied ahead (``pending``), read (``in_use``) or done."""

    index: int
    device: torch.device
    start: int
    end: int
    state: str
    tensor: torch.Tensor | None
    copied: Any  # the copy's event
    released: Any = None  # the event behind its last reader
    version: tuple[int, int] = (0, 0)  # the source's (version counter, address) when copied


def _version(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when the host weight is written in place (``mul_``, ``copy_``, an optimizer
    step, ``load_state_dict``) or given new memory (``param.data = ...``)."""
    return weight._version, weight.data_ptr()


def _saved_for_backward(weight: torch.Tensor, readers: Sequence[Any] | None) -> bool:
    """Whether autograd may save ``weight`` for the backward of the ops reading it: grad mode
    is on and the weight, or another input of its readers, requires grad (unknown: yes)."""
    if not torch.is_grad_enabled():
        return False
    if weight.requires_grad or readers is None:
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in readers)


class WeightStreamer(torch.nn.Module):
    """Copies streamed parameters to their device through a window, prefetching (see the module doc).

    Args:
        order: per streamed copy, in the order the forward reads them: ``(destination
            device, bytes)``.
        window: bytes of the device buffer holding the streamed weights in use and copied
            ahead; ``None``: twice the largest weight (double-buffering).

    The sources are bound after the module is built (:meth:`bind`): the parameter of
    each copy, held in a plain list (not registered again: ``copy.deepcopy`` of the
    module maps them to the copy's own parameters; ``load_state_dict`` and pinning
    change their ``.data`` in place and are seen).
    """

    def __init__(self, order: Sequence[tuple[str, int]], *, window: int | None = None) -> None:
        super().__init__()
        self.devices = [torch.device(device) for device, _ in order]
        self.sizes = [int(size) for _, size in order]
        self._window = int(window) if window is not None else None
        self.engine: Any = None  # None: per device, CUDA streams on a GPU, direct elsewhere
        self._cuda: CudaCopyEngine | None = None
        self._sources: list[torch.Tensor] = []
        self._lock = threading.RLock()
        self._reset_window()
        self._unsafe: str | None = None  # test-only: one of HAZARDS
        self.trace: list[tuple[str, int]] | None = None  # a list: ("copy" | "use" | "release", index)
        self.prefetched = 0  # copies made ahead of their use (since the last reset_stats)
        self.copies = 0  # copies made (since the last reset_stats)
        self.overflow = 0  # copies made outside the window (since the last reset_stats)
        self.stale = 0  # prefetched copies dropped: the host weight changed after (since reset_stats)
        self._unpinned_warned = False
        self._pinned: tuple[int, ...] | None = None  # the sources' addresses when last seen pinned

    def _reset_window(self) -> None:
        self._windows: dict[torch.device, torch.Tensor] = {}
        self._slots: dict[int, _Slot] = {}  # index -> its region of the window
        self._regions: dict[torch.device, list[_Slot]] = {}  # occupied regions per device
        self._offsets: list[int | None] | None = None
        self._next = 0

    def add(self, device: str, size: int) -> int:
        """Append a copy to ``device`` of ``size`` bytes; its index."""
        self.devices.append(torch.device(device))
        self.sizes.append(int(size))
        self._offsets = None
        return len(self.sizes) - 1

    def bind(self, sources: Sequence[torch.Tensor]) -> None:
        """Set each copy's source parameter (one per copy, in order)."""
        if len(sources) != len(self.sizes):
            raise ValueError(f"need {len(self.sizes)} sources, got {len(sources)}")
        self._sources = list(sources)

    def use(self, engine: Any) -> Any:
        """Run the copies on ``engine`` from now on (the window is made anew); returns it."""
        with self._lock:
            self.engine = engine
            self._reset_window()
        return engine

    @property
    def window(self) -> int:
        """Bytes of each device's window (unset: twice the largest weight)."""
        if self._window is not None:
            return self._window
        return 2 * aligned(max(self.sizes, default=0))

    @property
    def timing(self) -> bool:
        """Time every copy with CUDA events (a GPU's engine only)."""
        return self._cuda is not None and self._cuda.timing

    @timing.setter
    def timing(self, value: bool) -> None:
        if value and self._cuda is None:
            self._cuda = CudaCopyEngine()
        if self._cuda is not None:
            self._cuda.timing = bool(value)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and ``copy.deepcopy``: the configuration and the sources; not the lock, the
        engine, the window or the copies in flight (a copy starts with an empty window and the
        default engine)."""
        state = dict(self.__dict__)
        for key in ("_lock", "_windows", "_slots", "_regions", "_cuda", "engine", "_pinned"):
            state.pop(key, None)
        state["trace"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self.engine = None
        self._cuda = None
        self._pinned = None
        self._reset_window()

    def _check_pinned(self, engine: Any) -> None:
        """Host sources not pinned (``module.half()``, ``.to()`` made new tensors) are copied
        synchronously by CUDA: pin them again, in one arena, and say so once."""
        if not isinstance(engine, CudaCopyEngine) or not self._sources:
            return
        ptrs = tuple(p.data_ptr() for p in self._sources)
        if ptrs == self._pinned:
            return
        loose = [p for p in self._sources if p.device.type == "cpu" and not p.is_pinned()]
        if loose:
            if not self._unpinned_warned:
                log.warning(
                    "%d streamed weights are no longer in pinned host memory (the module's "
                    "parameters were replaced, e.g. by .half() or .to()): pinning them again",
                    len(loose),
                )
                self._unpinned_warned = True
            pin_arena(loose)
        self._pinned = tuple(p.data_ptr() for p in self._sources)

    def extra_repr(self) -> str:
        return f"copies={len(self.sizes)}, bytes={sum(self.sizes)}, window={self.window}"

    def forward(self, weight: torch.Tensor, index: int, readers: Sequence[Any] | None = None) -> torch.Tensor:
        """Weight ``index`` on its device, waited for on the current stream; then prefetch ahead.

        ``readers``: the other inputs of the ops that read the weight (None: unknown). With
        autograd on, a weight that autograd will save for the backward (it requires grad, or
        one of its readers' inputs does) is handed out as a fresh tensor, never a view of
        the window that a later refill would overwrite under the saved value.
        """
        device = self.devices[index]
        engine = self._engine(device)
        if isinstance(engine, DirectEngine):
            self.copies += 1
            return weight.to(device, non_blocking=True)
        self._check_pinned(engine)
        with self._lock:
            slot = self._slots.get(index)
            if slot is not None and slot.state == "pending" and slot.version != _version(weight):
                self._retire(slot, None)  # the host weight changed after its copy started: stale
                self.stale += 1
                slot = None
            if _saved_for_backward(weight, readers):
                tensor = self._fresh(index, weight, slot, engine)
            else:
                if slot is None or slot.state != "pending":
                    slot = self._place(index, weight)
                    self.overflow += slot is None
                tensor = (
                    self._fresh(index, weight, None, engine) if slot is None else self._hand_out(slot, engine)
                )
            self._log("use", index)
            self._next = index + 1
            self._prefetch(self._next)
        return tensor

    def _hand_out(self, slot: _Slot, engine: Any) -> torch.Tensor:
        """``slot``'s window view, read on the current stream after its copy's event."""
        assert slot.tensor is not None
        slot.state = "in_use"
        if self._unsafe != "skip_wait":
            engine.wait(slot.copied, slot.device)
        engine.reads(slot.tensor, slot.device)
        return slot.tensor

    def _fresh(self, index: int, weight: torch.Tensor, slot: _Slot | None, engine: Any) -> torch.Tensor:
        """A fresh tensor of weight ``index`` that autograd may keep: a device-side clone of its
        prefetched copy when it needs no gradient, else a copy that autograd flows through."""
        device = self.devices[index]
        if slot is not None and slot.state == "pending" and not weight.requires_grad:
            tensor = self._hand_out(slot, engine).clone()  # on the compute stream: its own pool
            self._retire(slot, engine.record(device))
            return tensor
        if slot is not None and slot.state == "pending":
            self._retire(slot, None)  # copied ahead without autograd
        tensor, event = engine.copy_new(weight, device)
        self.copies += 1
        if self._unsafe != "skip_wait":
            engine.wait(event, device)
        engine.reads(tensor, device)
        if self._unsafe != "skip_keep":
            engine.keep(tensor, device)  # allocated on the copy stream, read on this one
        return tensor

    def release(self, index: int) -> None:
        """The last reader of weight ``index`` is queued: its region may be refilled after it."""
        with self._lock:
            slot = self._slots.get(index)
            if slot is None or slot.state != "in_use":
                return
            engine = self._engine(slot.device)
            assert slot.tensor is not None
            engine.reads(slot.tensor, slot.device)  # the last reader
            self._retire(slot, engine.record(slot.device))
            self._log("release", index)
            self._prefetch(self._next)

    def reset_stats(self) -> None:
        """Forget the counters and timed events."""
        with self._lock:
            self.prefetched = self.copies = self.overflow = self.stale = 0
            if self._cuda is not None:
                self._cuda.timed.clear()

    def copy_seconds(self) -> float:
        """Seconds the timed copies took on their copy streams (synchronises; needs ``timing``)."""
        return self._cuda.copy_seconds() if self._cuda is not None else 0.0

    def drop_prefetched(self) -> None:
        """Give up the weights copied ahead (e.g. after a forward that stopped early)."""
        with self._lock:
            for slot in list(self._slots.values()):
                if slot.state == "pending":
                    self._retire(slot, None)

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""
        for engine in {id(e): e for e in (self.engine, self._cuda) if e is not None}.values():
            engine.synchronize()

    # -- internals --------------------------------------------------------------------------

    def _engine(self, device: torch.device) -> Any:
        if self.engine is not None:
            return self.engine
        if device.type == "cuda":
            if self._cuda is None:
                self._cuda = CudaCopyEngine()
            return self._cuda
        return engine_for(device)

    def _log(self, what: str, index: int) -> None:
        if self.trace is not None:
            self.trace.append((what, index))

    def _layout(self) -> list[int | None]:
        """Each weight's offset in its device's ring (first-use order); None: larger than the window."""
        if self._offsets is None:
            ends: dict[torch.device, int] = {}
            offsets: list[int | None] = []
            for device, size in zip(self.devices, self.sizes):
                size = aligned(size)
                if size > self.window:
                    offsets.append(None)
                    log.warning("a streamed weight of %d bytes exceeds the window (%d)", size, self.window)
                    continue
                start = ends.get(device, 0)
                if start + size > self.window:
                    start = 0
                offsets.append(start)
                ends[device] = start + size
            self._offsets = offsets
        return self._offsets

    def _retire(self, slot: _Slot, released: Any) -> None:
        """``slot``'s weight is no longer read (or was never handed out): its region may be refilled."""
        slot.state, slot.released, slot.tensor = "done", released, None

    def _place(self, index: int, source: torch.Tensor) -> _Slot | None:
        """Start copying weight ``index`` into its region of the window, if the region is free."""
        start = self._layout()[index]
        if start is None:
            return None
        device = self.devices[index]
        end = start + aligned(self.sizes[index])
        regions = self._regions.setdefault(device, [])
        overlapping = [s for s in regions if s.start < end and start < s.end]
        if self._unsafe != "skip_release" and any(s.state != "done" for s in overlapping):
            return None  # still read (or about to be): refill only after its release
        after = []
        for s in overlapping:
            regions.remove(s)
            if self._slots.get(s.index) is s:
                del self._slots[s.index]
            after += [s.released, s.copied]  # behind its last reader, and behind its own copy
        engine = self._engine(device)
        buffer = self._windows.get(device)
        if buffer is None:
            buffer = self._windows[device] = engine.alloc(device, self.window)
            if self._unsafe != "skip_window_keep":
                # allocated on the compute stream, written on the copy stream: freed (use(),
                # the module deleted) only behind the copies queued by then
                engine.keep_copying(buffer, device)
        nbytes = source.numel() * source.element_size()
        view = buffer[start : start + nbytes].view(source.dtype).view(source.shape)
        version = _version(source)
        event = engine.copy(source, view, after)
        slot = _Slot(index, device, start, end, "pending", view, event, version=version)
        regions.append(slot)
        self._slots[index] = slot
        self.copies += 1
        self._log("copy", index)
        return slot

    def _prefetch(self, start: int) -> None:
        """Copy weights ``start, start+1, ...`` (wrapping round) while their regions are free."""
        if not self._sources:
            return
        n = len(self.sizes)
        for step in range(n):
            index = (start + step) % n
            slot = self._slots.get(index)
            if slot is not None and slot.state != "done":
                continue
            source = self._sources[index]
            if torch.is_grad_enabled() and source.requires_grad:
                return  # the forward copies it to a fresh tensor (autograd)
            if isinstance(self._engine(self.devices[index]), DirectEngine):
                return
            if self._place(index, source) is None:
                return
            self.prefetched += 1


def pin_arena(params: Sequence[torch.Tensor], *, pin: bool = True) -> torch.Tensor:
    """Move ``params`` (host tensors, e.g. parameters) into one host arena, each at an
    ``ALIGN``-ed offset, pinned when ``pin``; the arena. One pinned block instead of one per
    tensor: the caching host allocator rounds each block up to a power of two, which for many
    separately pinned weights costs up to twice their bytes.

    Example:
        >>> import torch
        >>> params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2, 2))]
        >>> arena = pin_arena(params, pin=False)
        >>> arena.numel() == 2 * ALIGN, params[1].data.untyped_storage().data_ptr() == arena.data_ptr()
        (True, True)
        >>> params[0].tolist()
        [1.0, 1.0, 1.0]
    """
    sizes = [aligned(p.numel() * p.element_size()) for p in params]
    arena = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    offset = 0
    for param, size in zip(params, sizes):
        nbytes = param.numel() * param.element_size()
        view = arena[offset : offset + nbytes].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        offset += size
    return arena


def pin_streamed(module: torch.nn.Module, paths: Sequence[str]) -> int:
    """Pin the host memory of the parameters at ``paths`` in one arena (when CUDA is
    available, see :func:`pin_arena`); bytes of the arena."""
    if not torch.cuda.is_available():
        return 0
    params = {}
    for path in paths:
        param = module.get_parameter(path) if "." in path or hasattr(module, path) else None
        if param is None or param.device.type != "cpu" or param.is_pinned():
            continue
        params[id(param)] = param
    if not params:
        return 0
    arena = pin_arena(list(params.values()))
    pinned = arena.numel()
    log.info("pinned %d bytes of streamed parameters in one arena", pinned)
    return pinned


def measure_workspace(device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16) -> int:
    """GPU bytes the framework allocates for itself on the first matrix product (cuBLAS's
    workspace, through the caching allocator): the ``workspace=`` of :func:`placement.plan_offload`
    measured once. 0 without CUDA.

    Example:
        >>> import torch
        >>> workspace = measure_workspace("cuda")
        >>> workspace > 0 if torch.cuda.is_available() else workspace == 0
        True
    """
    if not torch.cuda.is_available():
        return 0
    device = torch.device(device)
    free_workspaces()
    torch.cuda.synchronize(device)
    a = torch.ones(256, 256, dtype=dtype, device=device)
    before = torch.cuda.memory_allocated(device)
    c = a @ a
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    del a, c
    return max(0, after - before - 256 * 256 * torch.tensor([], dtype=dtype).element_size())


def free_workspaces() -> bool:
    """Free cuBLAS's workspaces where this torch can (they are made again on the next product),
    so that a measurement sees them allocated; whether it could."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return False
    torch.cuda.synchronize()
    clear()
    return True
