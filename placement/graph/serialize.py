"""Saving and loading placed models as standard ONNX.

``save`` writes ONNX that ``onnx.checker`` accepts and a single plain ONNX Runtime
session can run: copies are ``Identity`` nodes. Placement is written twice:

* in ONNX's own multi-device fields (IR version 11+): one model-level
  ``DeviceConfigurationProto`` named ``placement`` listing the devices, and per
  node a ``NodeDeviceConfigurationProto`` whose ``pipeline_stage`` indexes it;
* mirrored in node ``metadata_props`` (``placement.device``), which ``load``
  reads first, so the placement restores exactly.

Big models: weights over 2 GB (or ``external_data=True``) go to ONNX external
data, ``<file>.<tag>.data`` beside the model, streamed tensor by tensor (tensors
of ``Constant`` ops too). ``load`` leaves external weights on disk: they are
``onnx_ir`` external tensors, memory-mapped when a runtime first reads them.

Saving is atomic: the model and its data file are written under temporary
names beside the target; the data file moves in under a name no earlier save
used, then the model file replaces the old one (the switch), then the old data
file is removed. The model records the tag written in its data file's header,
and ``load`` refuses a data file from another save. A symlink at the target path is replaced by the new
file (the file it pointed to is left alone) unless ``follow_symlinks=True``;
permission bits of a replaced regular file are kept, and non-regular files are
refused. A save killed half-way (``kill -9``) leaves a ``.placement-save-*``
folder behind: the next save into that folder removes it once its owner is
gone; SIGTERM during a save cleans up as SIGINT does.

Every path a model file names is confined to the model's folder: external data
``location`` entries and the data-pairing metadata must resolve (links
followed) to regular files inside it, and tensors handed to ONNX Runtime are
never left as relative references (ORT would resolve them against the working
directory).

Example:
    >>> import os, tempfile
    >>> import placement as pl
    >>> from placement.models import mlp
    >>> model = pl.from_torch(*mlp.build("tiny"))
    >>> path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    >>> model.save(path)
    >>> pl.load(path).devices == model.devices
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from placement.errors import ModelLoadError, ModelSaveError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import DEVICE_KEY, Model

__all__ = [
    "save",
    "load",
    "to_proto",
    "split_weights",
    "write_atomic",
    "write_file",
    "CONFIGURATION_NAME",
    "MAX_IR_VERSION",
    "TWO_GB",
    "DATA_CHECK_KEY",
    "SUPPLIED_LOCATION",
]

log = logging.getLogger(__name__)

#: Name of the ONNX device configuration ``placement`` writes.
CONFIGURATION_NAME = "placement"
#: The newest ONNX IR version ONNX Runtime reads.
MAX_IR_VERSION = 13
#: The IR version that introduced multi-device fields.
_MULTI_DEVICE_IR_VERSION = 11
#: Protobuf's hard limit; larger models must use external data.
TWO_GB = 2**31

ModelSource = Union[str, os.PathLike, onnx.ModelProto, ir.Model, Model]


def to_proto(model: Model) -> onnx.ModelProto:
    """Serialise a placed model to an ``onnx.ModelProto`` with placement annotations.

    Weights held in memory are copied into the proto (so it is limited to 2 GB);
    weights of a model loaded lazily from external data stay references to their
    data file (relative to the model's folder: do not hand this proto to ONNX
    Runtime, which resolves them against the working directory). For ONNX Runtime
    sessions of any size see :func:`split_weights`.
    The in-memory model is not modified.
    """
    proto = ir.serde.serialize_model(model.ir_model)
    proto.ir_version = min(max(proto.ir_version, _MULTI_DEVICE_IR_VERSION), MAX_IR_VERSION)
    devices = sorted({Device.parse(n.metadata_props.get(DEVICE_KEY, "cuda:0")) for n in model.graph})
    del proto.configuration[:]
    if devices:
        config = proto.configuration.add()
        config.name = CONFIGURATION_NAME
        config.num_devices = len(devices)
        config.device.extend(str(d) for d in devices)
        stage = {str(d): i for i, d in enumerate(devices)}
        for node in proto.graph.node:
            spec = next((p.value for p in node.metadata_props if p.key == DEVICE_KEY), None)
            del node.device_configurations[:]
            if spec is not None:
                ndc = node.device_configurations.add()
                ndc.configuration_id = CONFIGURATION_NAME
                ndc.pipeline_stage = stage[spec]
    return proto


def save(
    model: Model,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
    follow_symlinks: bool = False,
) -> None:
    """Write ``model`` to ``path`` atomically as standard ONNX.

    With external data the weights go to ``<file>.<tag>.data`` beside the
    model, where ``<tag>`` is new on every save. Both files are written under
    temporary names first; the new data file is moved in under its own new
    name, then the model file replaces the old one in one ``os.replace`` (the
    switch), and only then is the previous save's data file removed. At every
    moment the model file on disk pairs with its own weights, and the model
    records the tag, which :func:`load` checks against the data file's header.
    Weights are streamed tensor by tensor into the data file (from disk for a
    model loaded lazily), so saving never holds a second copy of them; tensors
    held in ``Constant`` attributes are moved out too.

    ``path`` may be a symlink: the link itself is replaced by the new file and
    the file it pointed to is left as it was; ``follow_symlinks=True`` writes
    the file the link points to instead (the link stays). An existing regular
    file keeps its permission bits. Anything that is not a regular file (a
    device node such as ``/dev/null``, a FIFO, a folder) is refused.

    Temporary folders (``.placement-save-<pid>-...``) left in the target folder
    by a save that was killed are removed here once their process is gone; a
    SIGTERM during the save (main thread) removes this save's temporary folder
    and then ends the process as SIGTERM would.

    Args:
        model: the placed model.
        path: target ``.onnx`` file; its folder must exist.
        external_data: store weights in a data file beside the model.
            ``None`` (default) does so only when they exceed 2 GB.
        follow_symlinks: when ``path`` is a symlink, write the file it points
            to rather than replacing the link.

    Raises:
        ModelSaveError: the folder is missing, the target is not a regular file,
            or the write failed; an existing file at ``path`` (and the data file
            it uses) is left as it was.

    Example:
        >>> import os, tempfile
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> folder = tempfile.mkdtemp()
        >>> open(os.path.join(folder, "victim.txt"), "w").write("keep")
        4
        >>> os.symlink("victim.txt", os.path.join(folder, "m.onnx"))
        >>> save(pl.from_torch(*mlp.build("tiny")), os.path.join(folder, "m.onnx"))
        >>> open(os.path.join(folder, "victim.txt")).read(), os.path.islink(os.path.join(folder, "m.onnx"))
        ('keep', False)
    """
    try:
        _save(model, path, external_data=external_data, follow_symlinks=follow_symlinks)
    except _Terminated:
        _die_by_sigterm()
        raise


def _save(
    model: Model, path: str | os.PathLike[str], *, external_data: bool | None, follow_symlinks: bool
) -> None:
    """The body of :func:`save`."""
    target = _save_target(Path(path), follow_symlinks=follow_symlinks)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ModelSaveError(f"cannot save to {str(path)!r}: folder {str(folder)!r} does not exist")
    mode = None
    if os.path.lexists(target) and not target.is_symlink():
        info = target.lstat()
        if stat.S_ISDIR(info.st_mode):
            raise ModelSaveError(f"cannot save to {str(path)!r}: it is a folder")
        if not stat.S_ISREG(info.st_mode):
            raise ModelSaveError(
                f"cannot save to {str(path)!r}: it exists and is not a regular file "
                "(a device, FIFO or socket); refusing to replace it"
            )
        mode = stat.S_IMODE(info.st_mode)
    clean_stale_temporaries(folder)
    clone = model.ir_model.clone()
    clone.metadata_props.pop(DATA_CHECK_KEY, None)
    tensors = _weight_slots(clone)
    weight_bytes = sum(_nbytes(get()) for get, _ in tensors)
    use_external = weight_bytes >= TWO_GB - 2**24 if external_data is None else external_data
    try:
        tmpdir = tempfile.mkdtemp(prefix=_temporary_prefix(), dir=folder)
    except OSError as err:
        raise ModelSaveError(f"cannot save to {str(path)!r}: {err}") from err
    data_name = None
    stale: list[Path] = []
    repoint: dict[int, ir.ExternalTensor] = {}
    moved_data: Path | None = None
    try:
        with _sigterm_cleans_up():
            tmp_model = Path(tmpdir) / target.name
            if use_external:
                tag = secrets.token_hex(8)
                data_name = f"{target.name}.{tag}.data"
                big = [(get, put) for get, put in tensors if _nbytes(get()) >= _EXTERNAL_THRESHOLD]
                header = ir.Tensor(np.frombuffer(_header(tag), dtype=np.uint8), name="placement.header")
                written = ir.external_data.convert_tensors_to_external(
                    [header, *(get() for get, _ in big)], tmpdir, data_name, alignment=4096
                )
                for (get, put), ext in zip(big, written[1:]):
                    repoint[id(get())] = ext
                    put(ext)
                clone.metadata_props[DATA_CHECK_KEY] = f"{data_name}:{tag}"
            else:  # one self-contained file: weights still on disk are read into the proto
                for get, put in tensors:
                    tensor = get()
                    if isinstance(tensor, ir.ExternalTensor):
                        put(ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name))
            proto = to_proto(Model(clone))
            with open(tmp_model, "wb") as f:
                f.write(proto.SerializeToString())
            del proto
            if mode is not None:
                os.chmod(tmp_model, mode)
            stale = _our_data_files(folder, target.name)
            if data_name is not None:
                if mode is not None:
                    os.chmod(Path(tmpdir) / data_name, mode)
                moved_data = folder / data_name
                os.replace(Path(tmpdir) / data_name, moved_data)
            os.replace(tmp_model, target)  # the switch: from here on the new pair is the model
            moved_data = None
    except (OSError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as err:
        raise ModelSaveError(f"failed to save {str(path)!r}: {err}") from err
    finally:
        if moved_data is not None and os.path.lexists(Path(tmpdir) / target.name):  # before the switch
            with contextlib.suppress(OSError):
                moved_data.unlink()
        shutil.rmtree(tmpdir, ignore_errors=True)
    _retire_data_files(model, [f for f in stale if f.name != data_name], folder, repoint)
    log.info(
        "saved %s (%d ops, %s of weights%s)",
        target,
        model.graph.num_nodes(),
        _format_bytes(weight_bytes),
        f", external data {data_name}" if data_name else "",
    )


def _save_target(path: Path, *, follow_symlinks: bool) -> Path:
    """The path a save replaces: ``path`` itself (a link there is replaced, not written
    through), or with ``follow_symlinks`` the file the link points to."""
    if follow_symlinks and path.is_symlink():
        return Path(os.path.realpath(path))
    return path


# --- temporary folders of saves --------------------------------------------------------

_TEMP_PREFIX = ".placement-save-"
_TEMP_OWNER = re.compile(re.escape(_TEMP_PREFIX) + r"(\d+)-(\d+)-")
#: A temporary folder whose name names no owner (older versions) is stale after this long.
_UNOWNED_STALE_SECONDS = 3600.0


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: fields follow the last ')'
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _temporary_prefix() -> str:
    """``.placement-save-<pid>-<start time>-``: who owns a temporary folder, for clean-up."""
    pid = os.getpid()
    return f"{_TEMP_PREFIX}{pid}-{_start_time(pid) or 0}-"


def _owner_alive(pid: int, started: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = _start_time(pid)
    return now is None or started == 0 or now == started  # a reused pid has another start time


def clean_stale_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary folders that killed saves left in ``folder``; return them.

    A folder named ``.placement-save-<pid>-<start>-...`` is stale when that process
    is gone (or the pid now belongs to a process started at another time); one
    from an older version, whose name names no owner, when it is over an hour old.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(folder, ".placement-save-999999999-1-abc"))
        >>> [p.name for p in clean_stale_temporaries(folder)]
        ['.placement-save-999999999-1-abc']
    """
    removed: list[Path] = []
    try:
        entries = [p for p in Path(folder).iterdir() if p.name.startswith(_TEMP_PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue
        owner = _TEMP_OWNER.match(entry.name)
        if owner is not None:
            stale = not _owner_alive(int(owner.group(1)), int(owner.group(2)))
        else:
            stale = now - info.st_mtime > _UNOWNED_STALE_SECONDS
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not os.path.lexists(entry):
                removed.append(entry)
                log.info("removed %s, left by a save that was killed", entry)
    return removed


class _Terminated(BaseException):
    """SIGTERM arrived during a save: unwind (removing temporaries), then end as SIGTERM would."""


@contextlib.contextmanager
def _sigterm_cleans_up() -> Iterator[None]:
    """While a save runs in the main thread, SIGTERM unwinds it like SIGINT does, then the
    process ends by SIGTERM as it would have (a handler the program set is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        previous = None
    if previous is not signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _die_by_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


#: Model metadata key recording the external data file and the tag in its header.
DATA_CHECK_KEY = "placement.external_data"
#: Tensors of at least this many bytes go to the data file.
_EXTERNAL_THRESHOLD = 1024
_HEADER_MAGIC = b"placement external data "
_HEADER_SIZE = 64


def _header(tag: str) -> bytes:
    return (_HEADER_MAGIC + tag.encode("ascii")).ljust(_HEADER_SIZE, b"\0")


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _nbytes(tensor: Any) -> int:
    return int(tensor.nbytes) if tensor is not None else 0


def _weight_slots(model: ir.Model) -> list[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """(get, put) pairs for every tensor of a model: initializers of every graph and
    tensor attributes (``Constant`` values) of every node, subgraphs included."""
    slots: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []

    def add_value(value: ir.Value) -> None:
        if value.const_value is None:
            return

        def put(tensor: Any, value: ir.Value = value) -> None:
            value.const_value = tensor

        slots.append((lambda value=value: value.const_value, put))

    for graph in model.graphs():
        for value in graph.initializers.values():
            add_value(value)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for name, attr in list(node.attributes.items()):
            if attr.is_ref() or attr.type != ir.AttributeType.TENSOR or attr.value is None:
                continue

            def put_attr(tensor: Any, node: ir.Node = node, name: str = name) -> None:
                node.attributes[name] = ir.Attr(name, ir.AttributeType.TENSOR, tensor)

            slots.append((lambda node=node, name=name: node.attributes[name].value, put_attr))
    return slots


def _our_data_files(folder: Path, model_name: str) -> list[Path]:
    """Data files an earlier :func:`save` of ``model_name`` wrote into ``folder``."""
    pattern = re.compile(re.escape(model_name) + r"\.[0-9a-f]{16}\.data")
    try:
        return [p for p in folder.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return []


def _retire_data_files(
    model: Model, stale: list[Path], folder: Path, repoint: dict[int, ir.ExternalTensor]
) -> None:
    """Delete the previous saves' data files; tensors of ``model`` read from one are
    re-pointed at the same bytes in the new data file first (``repoint``: id of a
    tensor -> where this save wrote it)."""
    if not stale:
        return
    gone = {os.path.realpath(p) for p in stale}
    for get, put in _weight_slots(model.ir_model):
        tensor = get()
        if not isinstance(tensor, ir.ExternalTensor) or os.path.realpath(tensor.path) not in gone:
            continue
        written = repoint.get(id(tensor))
        if written is not None:
            put(
                ir.ExternalTensor(
                    written.location,
                    written.offset,
                    written.length,
                    written.dtype,
                    shape=written.shape,
                    name=written.name or "",
                    base_dir=folder,
                )
            )
        else:  # saved inline this time: keep the bytes in memory
            put(ir.Tensor(np.array(tensor.numpy()), name=tensor.name))
    for path in stale:
        try:
            path.unlink()
        except OSError as err:
            log.warning("could not remove the previous data file %s: %s", path, err)


def load(source: ModelSource, *, device: DeviceLike = 0, initializers_as_inputs: bool = False) -> Model:
    """Load a model from an ONNX file, an ``onnx.ModelProto`` or an ``onnx_ir.Model``.

    Devices saved by :func:`save` are restored exactly; ops that carry none take
    the device stage from ONNX's multi-device fields if present, else ``device``.
    External data must lie inside the model's folder; it is not read here: the
    weights stay on disk and are memory-mapped when a runtime first reads them.
    A model saved by :func:`save` with external data is checked against its data
    file's header, so it never pairs with another save's weights.

    Models written for IR version 3 (old converters) list every initializer as a
    graph input too. They are normalised: initializers are parameters, not
    inputs (as from IR version 4 on), so runtimes treat them as constants. Pass
    ``initializers_as_inputs=True`` to keep such inputs listed. Dimensions
    written as ``-1`` (which ONNX Runtime reads as unknown) are read as dynamic,
    with one warning naming them (:func:`placement.graph.dims.dynamic_negative_dims`).

    Raises:
        ModelLoadError: the file is missing, truncated, not ONNX, or its
            external data is missing, too short, from another save or points
            outside its folder (subgraphs included; the message names the
            tensor and the op).

    Example:
        >>> import placement as pl
        >>> pl.load("does-not-exist.onnx")
        Traceback (most recent call last):
        ...
        placement.errors.ModelLoadError: no such model file: 'does-not-exist.onnx'
    """
    if isinstance(source, Model):
        model = source.copy()
    elif isinstance(source, ir.Model):
        model = _from_ir(source, device)
    elif isinstance(source, onnx.ModelProto):
        model = _from_proto(source, device, origin="the given ModelProto")
    elif isinstance(source, (str, os.PathLike)):
        model = _from_path(Path(source), device)
    else:
        raise ModelLoadError(
            f"cannot load a model from {type(source).__name__}: give a path, onnx.ModelProto or onnx_ir.Model"
        )
    if not initializers_as_inputs:
        _initializers_off_inputs(model)
    return model


def _initializers_off_inputs(model: Model) -> None:
    """Drop initializers from the graph inputs (IR version 3 style), keeping input order."""
    graph = model.graph
    listed = [v for v in graph.inputs if v.name in graph.initializers]
    for value in listed:
        graph.inputs.remove(value)
    if listed:
        if model.ir_model.ir_version < 4:
            model.ir_model.ir_version = 4
        log.info(
            "%d initializers were also graph inputs (IR version 3 style): now parameters only", len(listed)
        )


#: How often :func:`load` re-reads a model file that a concurrent save replaced.
_LOAD_ATTEMPTS = 5


def _from_path(path: Path, device: DeviceLike) -> Model:
    """Read, check and build a model file. A save that replaces the file (and retires
    its data file) while it is being read makes the checks of the old pair fail: the
    file is then read again, so a load sees the old pair or the new one, never a mix."""
    for attempt in range(_LOAD_ATTEMPTS):
        proto, identity = _read_model_file(path)
        try:
            _check_external_data(proto, path)
            _check_data_pairing(proto, path)
        except ModelLoadError:
            if attempt + 1 < _LOAD_ATTEMPTS and _file_identity(path) != identity:
                log.debug("%s was replaced while it was read; reading it again", path)
                continue
            raise
        return _from_proto(proto, device, origin=repr(str(path)), path=path)
    raise AssertionError("unreachable")  # pragma: no cover


def _file_identity(path: Path) -> tuple[int, ...] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _read_model_file(path: Path) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """Parse a model file (read once, through one descriptor) and say which file it was."""
    if not path.exists():
        raise ModelLoadError(f"no such model file: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {str(path)!r}")
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if info.st_size >= TWO_GB:
                raise ModelLoadError(
                    f"{str(path)!r} is {info.st_size} bytes, over protobuf's 2 GB limit: save its weights as "
                    "external data (onnx.save_model(..., save_as_external_data=True))"
                )
            data = f.read()
    except OSError as err:
        raise ModelLoadError(f"cannot read {str(path)!r}: {err}") from err
    if not data:
        raise ModelLoadError(f"{str(path)!r} is empty, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as err:
        raise ModelLoadError(f"{str(path)!r} is not a valid ONNX file (truncated or corrupt): {err}") from err
    return proto, (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _confined(path: Path, location: str, what: str) -> Path:
    """``location`` (named by the model file at ``path``) resolved inside the model's
    folder, links followed; refuse anything outside it, absolute, or not a regular file.
    Nothing outside the folder is opened or even looked at."""
    base = path.parent.resolve()
    if not location or os.path.isabs(location) or "\0" in location:
        raise ModelLoadError(
            f"{str(path)!r}: {what} points outside the model's folder ({location!r}); refusing to read it"
        )
    candidate = (base / location).resolve()
    if base not in candidate.parents:
        raise ModelLoadError(
            f"{str(path)!r}: {what} points outside the model's folder ({location!r}); refusing to read it"
        )
    try:
        info = candidate.stat()
    except OSError:
        raise ModelLoadError(f"{str(path)!r}: {what} {location!r} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelLoadError(
            f"{str(path)!r}: {what} {location!r} is not a regular file (a folder, FIFO or device); "
            "refusing to read it"
        )
    return candidate


def _graph_tensors(graph: onnx.GraphProto, where: str) -> Iterator[tuple[onnx.TensorProto, str]]:
    """Every tensor of a graph and its subgraphs, with where it sits (for messages)."""
    for tensor in graph.initializer:
        yield tensor, where
    for sparse in graph.sparse_initializer:
        yield sparse.values, where
        yield sparse.indices, where
    for node in graph.node:
        here = f"op {node.name or node.op_type!r}" + (f" (in {where})" if where != "the main graph" else "")
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t, here
            yield from ((t, here) for t in attr.tensors)
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g, f"a subgraph of {here}")
            for sub in attr.graphs:
                yield from _graph_tensors(sub, f"a subgraph of {here}")


def _check_external_data(proto: onnx.ModelProto, path: Path) -> None:
    """Refuse external data outside the model's folder, missing, not a regular file or
    too short (subgraphs included)."""
    sizes: dict[Path, int] = {}
    for tensor, where in _graph_tensors(proto.graph, "the main graph"):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        candidate = _confined(path, location, f"external data of tensor {tensor.name!r} ({where})")
        if candidate not in sizes:
            try:
                sizes[candidate] = candidate.stat().st_size
            except OSError:
                raise ModelLoadError(
                    f"{str(path)!r}: external data file {location!r} of tensor {tensor.name!r} "
                    f"({where}) is missing"
                ) from None
        try:
            offset, length = int(info.get("offset", 0) or 0), int(info.get("length", 0) or 0)
        except ValueError:
            raise ModelLoadError(
                f"{str(path)!r}: tensor {tensor.name!r} ({where}) has a malformed external data "
                f"offset/length {info.get('offset')!r}/{info.get('length')!r}"
            ) from None
        needed = length or _proto_nbytes(tensor)
        if offset < 0 or length < 0 or offset + needed > sizes[candidate]:
            raise ModelLoadError(
                f"{str(path)!r}: external data file {location!r} is truncated "
                f"(tensor {tensor.name!r} ({where}) needs bytes up to {offset + needed})"
            )


def _proto_nbytes(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= int(dim)
    try:
        return count * ir.DataType(tensor.data_type).itemsize
    except ValueError:
        return 0


def _check_data_pairing(proto: onnx.ModelProto, path: Path) -> None:
    """A model saved with external data names its data file and the tag in its header;
    refuse a data file that another save wrote. The file it names is confined to the
    model's folder like every external data location, and opened without blocking."""
    props = {p.key: p.value for p in proto.metadata_props}
    spec = props.get(DATA_CHECK_KEY)
    if not spec:
        return
    location, _, tag = spec.rpartition(":")
    data_path = _confined(path, location, f"the external data file its metadata names ({DATA_CHECK_KEY})")
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ModelLoadError(f"{str(path)!r}: cannot read its external data {location!r}: {err}") from err
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for a FIFO since it was checked
            raise ModelLoadError(f"{str(path)!r}: external data {location!r} is not a regular file")
        head = os.read(fd, _HEADER_SIZE)
    except OSError as err:
        raise ModelLoadError(f"{str(path)!r}: cannot read its external data {location!r}: {err}") from err
    finally:
        os.close(fd)
    if head != _header(tag):
        raise ModelLoadError(
            f"{str(path)!r}: external data file {location!r} belongs to another save "
            "(its content check does not match the model); refusing to pair them"
        )


def _from_proto(
    proto: onnx.ModelProto, device: DeviceLike, *, origin: str, path: Path | None = None
) -> Model:
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{origin} is not an ONNX model (no graph or opset); is the file truncated?")
    _sort_nodes(proto.graph, origin)
    try:
        # The proto that was parsed is checked (never the file again: a concurrent save may
        # have replaced it); external data locations were checked by _check_external_data.
        onnx.checker.check_model(_checkable(proto))
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise ModelLoadError(f"{origin} is not valid ONNX (truncated or corrupt?): {first}") from err
    except ValueError as err:  # > 2 GB protos: checked piecewise by ORT later
        log.debug("skipping onnx.checker for %s: %s", origin, err)
    stages = _stage_devices(proto)
    try:
        ir_model = ir.serde.deserialize_model(proto)
    except Exception as err:  # onnx_ir raises several types on malformed protos
        raise ModelLoadError(f"cannot read {origin}: {err}") from err
    if path is not None:  # external tensors stay on disk, memory-mapped when first read
        ir.external_data.set_base_dir(ir_model.graph, path.parent)
    ir_model.metadata_props.pop(DATA_CHECK_KEY, None)
    return _from_ir(ir_model, device, stages)


def _checkable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` for ``onnx.checker``: with external tensors, a copy in which they are empty.

    Given a proto, the checker resolves external data against the working directory;
    their locations were checked against the model's folder already
    (:func:`_check_external_data`), so the copy leaves them out. Only models with
    external data are copied, and their copies hold no weights of note.
    """
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t, _ in _graph_tensors(proto.graph, "")):
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for tensor, _ in _graph_tensors(copy.graph, ""):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.dims[:]
            tensor.dims.append(0)
    return copy


def _sort_nodes(graph: onnx.GraphProto, origin: str) -> None:
    """Put the nodes of ``graph`` (and its subgraphs) in topological order, in place.

    ONNX requires the order but ONNX Runtime does not, so such files exist. Nodes
    already in order keep it (a stable sort by position); a cycle is left for the
    checker to report.
    """
    import networkx as nx

    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _sort_nodes(sub, origin)
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    edges: list[tuple[int, int]] = []
    in_order = True
    for i, node in enumerate(graph.node):
        for name in _names_used(node):
            j = producer.get(name)
            if j is not None and j != i:
                edges.append((j, i))
                in_order = in_order and j < i
    if in_order:
        return
    dag = nx.DiGraph(edges)
    dag.add_nodes_from(range(len(graph.node)))
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible:
        return
    nodes = [graph.node[i] for i in order]
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)
    log.debug("%s: nodes of graph %r were not in topological order; sorted them", origin, graph.name)


def _names_used(node: onnx.NodeProto) -> Iterator[str]:
    """The value names a node reads: its inputs and, from its subgraphs, outer-scope names."""
    yield from (name for name in node.input if name)
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for inner in sub.node:
                yield from _names_used(inner)


def _stage_devices(proto: onnx.ModelProto) -> dict[str, str]:
    """Node name -> device from ONNX multi-device fields (for files made elsewhere)."""
    configs = {c.name: list(c.device) for c in proto.configuration}
    result: dict[str, str] = {}
    for node in proto.graph.node:
        for ndc in node.device_configurations:
            names = configs.get(ndc.configuration_id)
            if names and ndc.HasField("pipeline_stage") and 0 <= ndc.pipeline_stage < len(names):
                try:
                    result[node.name] = str(Device.parse(names[ndc.pipeline_stage]))
                except Exception:  # a device name we do not understand: ignore the field
                    continue
                break
    return result


def _from_ir(ir_model: ir.Model, device: DeviceLike, stages: dict[str, str] | None = None) -> Model:
    from onnx_ir.passes.common import NameFixPass

    NameFixPass()(ir_model)
    if stages:
        for node in ir_model.graph:
            if DEVICE_KEY not in node.metadata_props and node.name in stages:
                node.metadata_props[DEVICE_KEY] = stages[node.name]
    for node in ir_model.graph:
        spec = node.metadata_props.get(DEVICE_KEY)
        if spec is not None:
            try:
                Device.parse(spec)
            except Exception as err:
                raise ModelLoadError(f"op {node.name!r} has a bad device annotation {spec!r}: {err}") from err
    return Model(ir_model, device=device)


#: The location that marks a weight supplied to ONNX Runtime outside the protobuf.
SUPPLIED_LOCATION = "placement-supplied-weight"


def split_weights(
    model: Model | ir.Model, *, threshold: int = _EXTERNAL_THRESHOLD
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Serialise a model with its large weights left out, for ONNX Runtime.

    Every main-graph initializer of ``threshold`` bytes or more (in a dtype numpy
    and ONNX Runtime share) is written to the proto as an external-data stub at
    :data:`SUPPLIED_LOCATION` and returned as an array instead: memory-mapped for
    a model loaded lazily, the model's own array otherwise (never a copy). Give
    them to the session with ``SessionOptions.add_external_initializers``; the
    proto stays small, so a model of any size loads. A :class:`Model` gets its
    placement annotations as in :func:`to_proto`. Initializers that nothing reads
    (not an op, in the graph or a subgraph, nor a graph input or output) are left
    out, as ONNX Runtime would drop them before taking the supplied weights. The
    model is not modified. Every other tensor still on disk (under ``threshold``,
    in subgraphs or ``Constant`` ops) is read into the proto: ONNX Runtime would
    resolve a relative data-file reference against the working directory, not the
    model's folder.

    Example:
        >>> import placement as pl
        >>> from placement.models import mlp
        >>> proto, weights = split_weights(pl.from_torch(*mlp.build("tiny")).ir_model, threshold=0)
        >>> len(weights) == len(proto.graph.initializer)
        True
        >>> all(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
        True
    """
    clone = (model.ir_model if isinstance(model, Model) else model).clone()
    _drop_unread_initializers(clone.graph)
    weights: dict[str, np.ndarray] = {}
    for name, value in clone.graph.initializers.items():
        tensor = value.const_value
        if tensor is None or tensor.nbytes < threshold:
            continue
        try:
            array = tensor.numpy()
        except Exception as err:  # noqa: BLE001 (a tensor type numpy cannot hold: leave it inline)
            log.debug("weight %s stays in the proto: %s", name, err)
            continue
        if array.dtype.kind not in "fiub" or not array.dtype.isnative:
            continue
        weights[name] = np.ascontiguousarray(array)
        value.const_value = ir.ExternalTensor(
            SUPPLIED_LOCATION, 0, int(tensor.nbytes), tensor.dtype, shape=tensor.shape, name=name
        )
    _inline_external(clone)
    if isinstance(model, Model):
        return to_proto(Model(clone)), weights
    proto = ir.serde.serialize_model(clone)
    proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
    return proto, weights


def _drop_unread_initializers(graph: ir.Graph) -> None:
    """Remove the initializers of ``graph`` that no op (in it or a subgraph) reads and that
    are neither graph inputs nor outputs.

    ONNX Runtime removes them itself when it loads a graph, *before* it takes the
    weights handed to ``add_external_initializers``; a supplied weight whose
    initializer is gone fails the session ("Failed to find existing initializer").
    """
    keep = set(graph.inputs) | set(graph.outputs)
    for name, value in list(graph.initializers.items()):
        if value not in keep and not value.uses():
            log.debug("initializer %s is read by no op: left out of the session", name)
            del graph.initializers[name]


def _inline_external(model: ir.Model) -> None:
    """Read every tensor still stored in a data file (small ones, tensors of subgraphs and
    ``Constant`` ops, dtypes numpy lacks) into memory, so that no relative data-file
    reference reaches ONNX Runtime: it would resolve it against the working directory,
    not the model's folder. Stubs at :data:`SUPPLIED_LOCATION` stay."""
    for get, put in _weight_slots(model):
        tensor = get()
        if isinstance(tensor, ir.ExternalTensor) and tensor.location != SUPPLIED_LOCATION:
            put(ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name))


def write_atomic(
    path: str | os.PathLike[str], data: bytes, *, what: str = "file", follow_symlinks: bool = False
) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file beside it, then ``os.replace``).

    A symlink at ``path`` is replaced by the new file (what it pointed to is left
    alone) unless ``follow_symlinks=True``, which writes the file it points to.
    An existing regular file keeps its permission bits; targets that are not
    regular files are refused. On any failure the old file is untouched and an
    ``OSError`` propagates (callers wrap it in their own error).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> write_atomic(path, b"{}")
        >>> open(path).read()
        '{}'
    """
    target = _save_target(Path(path), follow_symlinks=follow_symlinks)
    folder = target.parent if str(target.parent) else Path(".")
    mode = None
    if os.path.lexists(target) and not target.is_symlink():
        info = target.lstat()
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{str(path)!r} exists and is not a regular file; refusing to replace it")
        mode = stat.S_IMODE(info.st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    log.debug("wrote %s %s (%d bytes)", what, target, len(data))


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`write_atomic` for user-facing outputs: any failure is a ``ModelSaveError``.

    Raises:
        ModelSaveError: the file cannot be written (the message names it); an old
            file at ``path`` is left as it was.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "out.txt")
        >>> write_file(path, b"hi")
        >>> write_file(os.path.join(path, "inside"), b"hi")
        Traceback (most recent call last):
        ...
        placement.errors.ModelSaveError: cannot write ...
    """
    try:
        write_atomic(path, data)
    except OSError as err:
        raise ModelSaveError(f"cannot write {str(path)!r}: {err}") from err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
