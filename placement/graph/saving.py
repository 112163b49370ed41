"""Saving placed models as standard ONNX, atomically, with external data for big models.

``save`` writes ONNX that ``onnx.checker`` accepts and a single plain ONNX Runtime
session can run: copies are ``Identity`` nodes. Placement is written twice:

* in ONNX's own multi-device fields (IR version 11+): one model-level
  ``DeviceConfigurationProto`` named ``placement`` listing the devices, and per
  node a ``NodeDeviceConfigurationProto`` whose ``pipeline_stage`` indexes it;
* mirrored in node ``metadata_props`` (``placement.device``), which
  :func:`placement.graph.loading.load` reads first, so the placement restores exactly.

Big models: weights over 2 GB (or ``external_data=True``) go to ONNX external
data, ``<file>.<tag>.data`` beside the model, streamed tensor by tensor (tensors
of ``Constant`` ops too).

Saving is atomic (:mod:`placement.graph.atomic`): the model and its data file are
written under temporary names beside the target; the data file moves in under a
name no earlier save used, then the model file replaces the old one (the switch),
then the old data file is removed. The model records the tag written in its data
file's header, and ``load`` refuses a data file from another save. A symlink at the
target path is replaced by the new file (the file it pointed to is left alone) unless
``follow_symlinks=True``; permission bits of a replaced regular file are kept, and
non-regular files are refused.

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
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from placement.errors import ModelSaveError
from placement.graph.atomic import _save_target, _temporary_prefix, clean_stale_temporaries
from placement.graph.device import Device
from placement.graph.dims import dynamic_negative_dims
from placement.graph.nodes import DEVICE_KEY
from placement.graph.save_guard import deferred, drop_temporary, guarded, make_temporary
from placement.graph.sizes import format_bytes

if TYPE_CHECKING:
    from placement.graph.placed import PlacedModel

__all__ = [
    "to_proto",
    "save",
    "CONFIGURATION_NAME",
    "MAX_IR_VERSION",
    "MULTI_DEVICE_FIELDS",
    "TWO_GB",
    "DATA_CHECK_KEY",
]

log = logging.getLogger(__name__)


#: Name of the ONNX device configuration ``placement`` writes.
CONFIGURATION_NAME = "placement"
#: The newest ONNX IR version ONNX Runtime reads.
MAX_IR_VERSION = 13
#: The IR version that introduced multi-device fields.
_MULTI_DEVICE_IR_VERSION = 11
#: Whether the installed onnx has them (onnx 1.18 and newer): without them the placement is
#: saved in node metadata only, at an IR version that onnx reads.
MULTI_DEVICE_FIELDS = "configuration" in onnx.ModelProto.DESCRIPTOR.fields_by_name
#: Protobuf's hard limit; larger models must use external data.
TWO_GB = 2**31


def to_proto(model: PlacedModel) -> onnx.ModelProto:
    """Serialise a placed model to an ``onnx.ModelProto`` with placement annotations.

    Weights held in memory are copied into the proto (so it is limited to 2 GB);
    weights of a model loaded lazily from external data stay references to their
    data file (relative to the model's folder: do not hand this proto to ONNX
    Runtime, which resolves them against the working directory). For ONNX Runtime
    sessions of any size see :func:`~placement.graph.weights.split_weights`.
    The in-memory model is not modified.
    """
    return _proto_of(model.ir_model)


def _proto_of(ir_model: ir.Model) -> onnx.ModelProto:
    """The ONNX proto of a placed IR model, with ONNX's multi-device fields filled in."""
    proto = ir.serde.serialize_model(ir_model)
    _drop_initializer_value_info(proto.graph)
    _constants_as_tensors(proto.graph)
    if not MULTI_DEVICE_FIELDS:
        proto.ir_version = min(proto.ir_version, MAX_IR_VERSION, onnx.IR_VERSION)
        return proto
    proto.ir_version = min(max(proto.ir_version, _MULTI_DEVICE_IR_VERSION), MAX_IR_VERSION)
    devices = sorted({Device.parse(n.metadata_props.get(DEVICE_KEY, "cuda:0")) for n in ir_model.graph})
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


def _drop_initializer_value_info(graph: onnx.GraphProto) -> None:
    """Remove ``value_info`` entries that repeat an initializer's type.

    An initializer's tensor states its type; a ``value_info`` copy of it is redundant
    and goes stale when a tool rewrites the initializer under its name (ONNX Runtime's
    ``quantize_dynamic`` transposes a ``Gemm``'s weight in place, and then refuses the
    file: "Inferred shape and existing shape differ").
    """
    initializers = {t.name for t in graph.initializer}
    if not initializers or not any(v.name in initializers for v in graph.value_info):
        return
    kept = [v for v in graph.value_info if v.name not in initializers]
    del graph.value_info[:]
    graph.value_info.extend(kept)


#: ``Constant`` attributes other than ``value`` -> (tensor type, whether a list)
_CONSTANT_FORMS = {
    "value_int": (onnx.TensorProto.INT64, False),
    "value_ints": (onnx.TensorProto.INT64, True),
    "value_float": (onnx.TensorProto.FLOAT, False),
    "value_floats": (onnx.TensorProto.FLOAT, True),
}


def _constants_as_tensors(graph: onnx.GraphProto) -> None:
    """Write ``Constant(value_int[s]/value_float[s])`` as the same ``Constant(value=tensor)``.

    Both forms are standard; ONNX Runtime's symbolic shape inference (``quant_pre_process``,
    the quantizer's recommended first step) reads only ``value``. Subgraphs too.
    """
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _constants_as_tensors(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _constants_as_tensors(sub)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        if attr.name not in _CONSTANT_FORMS:
            continue
        dtype, is_list = _CONSTANT_FORMS[attr.name]
        values = onnx.helper.get_attribute_value(attr)
        tensor = onnx.helper.make_tensor(
            "value", dtype, [len(values)] if is_list else [], values if is_list else [values]
        )
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", tensor))


def save(
    model: PlacedModel,
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
    with guarded():  # installed before the temporary folder exists, restored after it is gone
        _save(model, path, external_data=external_data, follow_symlinks=follow_symlinks)


def _save(
    model: PlacedModel, path: str | os.PathLike[str], *, external_data: bool | None, follow_symlinks: bool
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
    data_name = None
    stale: list[Path] = []
    repoint: dict[int, ir.ExternalTensor] = {}
    moved_data: Path | None = None
    try:  # registered before it exists: a SIGTERM from here on removes it (save_guard)
        tmpdir = make_temporary(folder, _temporary_prefix())
    except OSError as err:
        raise ModelSaveError(f"cannot save to {str(path)!r}: {err}") from err
    try:
        tmp_model = tmpdir / target.name
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
        dynamic_negative_dims(clone)  # as a Model built on the clone would: the same proto
        for node in clone.graph:
            node.metadata_props.setdefault(DEVICE_KEY, "cuda:0")
        proto = _proto_of(clone)
        with open(tmp_model, "wb") as f:
            f.write(proto.SerializeToString())
        del proto
        if mode is not None:
            os.chmod(tmp_model, mode)
        stale = _our_data_files(folder, target.name)
        with deferred():  # the renames happen whole, whenever a SIGTERM lands
            if data_name is not None:
                if mode is not None:
                    os.chmod(tmpdir / data_name, mode)
                moved_data = folder / data_name
                os.replace(tmpdir / data_name, moved_data)
            os.replace(tmp_model, target)  # the switch: from here on the new pair is the model
            moved_data = None
    except (OSError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as err:
        raise ModelSaveError(f"failed to save {str(path)!r}: {err}") from err
    finally:
        with deferred():  # the clean-up runs whole; a SIGTERM meanwhile is raised after it
            if moved_data is not None and os.path.lexists(tmpdir / target.name):  # before the switch
                with contextlib.suppress(OSError):
                    moved_data.unlink()
            drop_temporary(tmpdir)
    _retire_data_files(model, [f for f in stale if f.name != data_name], folder, repoint)
    log.info(
        "saved %s (%d ops, %s of weights%s)",
        target,
        model.graph.num_nodes(),
        format_bytes(weight_bytes),
        f", external data {data_name}" if data_name else "",
    )


#: Model metadata key recording the external data file and the tag in its header.
DATA_CHECK_KEY = "placement.external_data"
#: Tensors of at least this many bytes go to the data file.
_EXTERNAL_THRESHOLD = 1024
_HEADER_MAGIC = b"placement external data "
_HEADER_SIZE = 64


def _header(tag: str) -> bytes:
    return (_HEADER_MAGIC + tag.encode("ascii")).ljust(_HEADER_SIZE, b"\0")


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
    model: PlacedModel, stale: list[Path], folder: Path, repoint: dict[int, ir.ExternalTensor]
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
