"""External-data confinement: every path a model file names stays inside the model's folder.

External data ``location`` entries and the data-pairing metadata must resolve (links
followed) to regular files inside the model's folder; nothing is resolved against
the working directory, and a data file from another save is refused.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> (folder / "w.data").write_bytes(b"")
    0
    >>> _confined(folder / "m.onnx", "w.data", "weight w").name
    'w.data'
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from placement.errors import ModelLoadError
from placement.graph.saving import _HEADER_SIZE, DATA_CHECK_KEY, _header

__all__ = []

log = logging.getLogger(__name__)


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


def _without_external_data(proto: onnx.ModelProto) -> onnx.ModelProto:
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
