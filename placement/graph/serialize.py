"""Saving and loading placed models as standard ONNX.

``save`` writes ONNX that ``onnx.checker`` accepts and a single plain ONNX Runtime
session can run: copies are ``Identity`` nodes. Placement is written twice:

* in ONNX's own multi-device fields (IR version 11+): one model-level
  ``DeviceConfigurationProto`` named ``placement`` listing the devices, and per
  node a ``NodeDeviceConfigurationProto`` whose ``pipeline_stage`` indexes it;
* mirrored in node ``metadata_props`` (``placement.device``), which ``load``
  reads first, so the placement restores exactly.

Saving is atomic: the model (and its external data file) are written to a
temporary folder beside the target and renamed into place, so a failed save
never destroys an existing file. Models whose parameters exceed 2 GB use ONNX
external data (``<file>.data`` beside the model).

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

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from placement.errors import ModelLoadError, ModelSaveError
from placement.graph.device import Device, DeviceLike
from placement.graph.model import DEVICE_KEY, Model

__all__ = ["save", "load", "to_proto", "CONFIGURATION_NAME", "MAX_IR_VERSION", "TWO_GB"]

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


def save(model: Model, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Write ``model`` to ``path`` atomically as standard ONNX.

    Args:
        model: the placed model.
        path: target ``.onnx`` file; its folder must exist.
        external_data: store parameters in ``<file>.data`` beside the model.
            ``None`` (default) does so only when they exceed 2 GB.

    Raises:
        ModelSaveError: the folder is missing or the write failed; an existing
            file at ``path`` is left as it was.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ModelSaveError(f"cannot save to {str(target)!r}: folder {str(folder)!r} does not exist")
    if target.is_dir():
        raise ModelSaveError(f"cannot save to {str(target)!r}: it is a folder")
    proto = to_proto(model)
    param_bytes = sum(
        int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None
    )
    use_external = param_bytes >= TWO_GB - 2**24 if external_data is None else external_data
    data_name = target.name + ".data"
    try:
        tmpdir = tempfile.mkdtemp(prefix=".placement-save-", dir=folder)
    except OSError as err:
        raise ModelSaveError(f"cannot save to {str(target)!r}: {err}") from err
    try:
        tmp_model = Path(tmpdir) / target.name
        if use_external:
            onnx.save_model(
                proto,
                tmp_model,
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=data_name,
                size_threshold=1024,
            )
        else:
            onnx.save_model(proto, tmp_model)
        tmp_data = Path(tmpdir) / data_name
        if tmp_data.exists():
            os.replace(tmp_data, folder / data_name)
        os.replace(tmp_model, target)
    except (OSError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as err:
        raise ModelSaveError(f"failed to save {str(target)!r}: {err}") from err
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    log.info("saved %s (%d ops, external data: %s)", target, model.graph.num_nodes(), use_external)


def load(source: ModelSource, *, device: DeviceLike = 0) -> Model:
    """Load a model from an ONNX file, an ``onnx.ModelProto`` or an ``onnx_ir.Model``.

    Devices saved by :func:`save` are restored exactly; ops that carry none take
    the device stage from ONNX's multi-device fields if present, else ``device``.
    External data must lie inside the model's folder.

    Raises:
        ModelLoadError: the file is missing, truncated, not ONNX, or its
            external data points outside its folder.

    Example:
        >>> import placement as pl
        >>> pl.load("does-not-exist.onnx")
        Traceback (most recent call last):
        ...
        placement.errors.ModelLoadError: no such model file: 'does-not-exist.onnx'
    """
    if isinstance(source, Model):
        return source.copy()
    if isinstance(source, ir.Model):
        return _from_ir(source, device)
    if isinstance(source, onnx.ModelProto):
        return _from_proto(source, device, origin="the given ModelProto")
    if isinstance(source, (str, os.PathLike)):
        return _from_path(Path(source), device)
    raise ModelLoadError(
        f"cannot load a model from {type(source).__name__}: give a path, onnx.ModelProto or onnx_ir.Model"
    )


def _from_path(path: Path, device: DeviceLike) -> Model:
    if not path.exists():
        raise ModelLoadError(f"no such model file: {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {str(path)!r}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelLoadError(f"cannot read {str(path)!r}: {err}") from err
    if not data:
        raise ModelLoadError(f"{str(path)!r} is empty, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as err:
        raise ModelLoadError(f"{str(path)!r} is not a valid ONNX file (truncated or corrupt): {err}") from err
    _check_external_data(proto, path)
    try:
        onnx.load_external_data_for_model(proto, str(path.parent))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the external data of {str(path)!r}: {err}") from err
    return _from_proto(proto, device, origin=repr(str(path)))


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    tensors = list(proto.graph.initializer)
    for node in proto.graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                tensors.append(attr.t)
    return [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]


def _check_external_data(proto: onnx.ModelProto, path: Path) -> None:
    """Refuse external data outside the model's folder, missing or too short."""
    base = path.parent.resolve()
    for tensor in _external_tensors(proto):
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        candidate = (base / location).resolve()
        if not location or os.path.isabs(location) or base not in (candidate, *candidate.parents):
            raise ModelLoadError(
                f"{str(path)!r}: external data of tensor {tensor.name!r} points outside the "
                f"model's folder ({location!r}); refusing to read it"
            )
        if not candidate.is_file():
            raise ModelLoadError(
                f"{str(path)!r}: external data file {location!r} of tensor {tensor.name!r} is missing"
            )
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        if end > candidate.stat().st_size:
            raise ModelLoadError(
                f"{str(path)!r}: external data file {location!r} is truncated "
                f"(tensor {tensor.name!r} needs bytes up to {end})"
            )


def _from_proto(proto: onnx.ModelProto, device: DeviceLike, *, origin: str) -> Model:
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{origin} is not an ONNX model (no graph or opset); is the file truncated?")
    try:
        onnx.checker.check_model(proto)
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
    return _from_ir(ir_model, device, stages)


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
