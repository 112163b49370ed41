"""``TCPStore`` servers bound to the loopback interface, and what listens where.

Inside :func:`loopback_stores` (``python -m placement.distributed.torchrun --loopback``
runs torchrun so), the stores torchrun's agent hosts (the c10d rendezvous store and
the store it shares with the ranks) listen on ``127.0.0.1`` instead of every interface.
``torch.distributed.TCPStore`` binds the wildcard address whatever host it is given;
its ``master_listen_fd`` argument takes a socket already listening, so the server
here is handed one bound to ``127.0.0.1`` (on the requested port, or a free one).
Use it with ``--local-addr 127.0.0.1 --rdzv-endpoint 127.0.0.1:PORT`` so that the
ranks connect to the loopback address (:func:`placement.distributed.launcher.torchrun_command`
builds that command).

Example:
    >>> import torch.distributed as dist
    >>> with loopback_stores():
    ...     store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    ...     ("127.0.0.1", store.port) in listening_addresses()
    True
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["loopback_stores", "listening_addresses", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def _loopback_store_class(original: Any) -> Any:
    class LoopbackTCPStore(original):  # type: ignore[misc, valid-type]
        """A ``TCPStore`` whose server (``is_master=True``) listens on 127.0.0.1 only."""

        _sockets: list[socket.socket] = []  # kept open for the life of the process

        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            names = ["world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant"]
            named = dict(zip(names, args))
            named.update(kwargs)
            if named.get("is_master") and named.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((LOOPBACK, int(port)))
                sock.listen(socket.SOMAXCONN)
                LoopbackTCPStore._sockets.append(sock)
                named["master_listen_fd"] = sock.fileno()
                port = sock.getsockname()[1]
            super().__init__(host_name, port, **named)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "TCPStore"
    return LoopbackTCPStore


@contextlib.contextmanager
def loopback_stores() -> Iterator[None]:
    """While inside, ``TCPStore`` servers created through ``torch.distributed`` (and
    torchrun's rendezvous backends) listen on 127.0.0.1 only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore
    patched = _loopback_store_class(original)
    dist.TCPStore = patched
    c10d_rendezvous_backend.TCPStore = patched  # imported by name there
    try:
        yield
    finally:
        dist.TCPStore = original
        c10d_rendezvous_backend.TCPStore = original


def listening_addresses(pids: set[int] | None = None) -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets listening in this network namespace
    (``/proc/net/tcp`` and ``tcp6``), only those of processes ``pids`` if given.

    IPv6 addresses are written in full hex; ``"::"`` and ``"0.0.0.0"`` mean every interface.
    """
    inodes = _socket_inodes(pids) if pids is not None else None
    found: set[tuple[str, int]] = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            if inodes is not None and fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            found.add((_address(address, v6), int(port, 16)))
    return found


def _address(text: str, v6: bool) -> str:
    raw = bytes.fromhex(text)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    return inodes
