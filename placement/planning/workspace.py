"""The GPU workspace margin a plan keeps free: cuBLAS's workspace, per stream that runs kernels.

cuBLAS allocates its workspace through torch's caching allocator, once per stream (and
handle) that runs a matrix product: up to 32 MiB on Hopper. An offload plan runs one compute
stream on the GPU (its copy stream runs no cuBLAS), so :func:`default_workspace` keeps 32 MiB
where the budget allows. Measure the real figure with
:func:`placement.runtime.torch.streaming.measure_workspace` and pass it as ``workspace=``.

Example:
    >>> default_workspace(24 << 30) == DEFAULT_WORKSPACE
    True
"""

from __future__ import annotations

import logging

__all__ = ["DEFAULT_WORKSPACE", "WORKSPACE_SHARE", "default_workspace"]

log = logging.getLogger(__name__)

#: The GPU workspace margin (``workspace=``) per stream that runs kernels: cuBLAS keeps up to
#: 32 MiB per stream on Hopper (``CUBLAS_WORKSPACE_CONFIG``'s default there), allocated
#: through torch's caching allocator.
DEFAULT_WORKSPACE = 32 << 20
#: The share of a toy GPU budget (below twice :data:`DEFAULT_WORKSPACE`) the default margin takes.
WORKSPACE_SHARE = 0.05


def default_workspace(budget: int | None, *, streams: int = 1) -> int:
    """The default ``workspace=`` of :func:`plan_offload`: :data:`DEFAULT_WORKSPACE` per stream
    that runs kernels on the GPU (a plan runs one compute stream; its copy stream runs no
    cuBLAS), as long as that leaves at least half of ``budget``; below that the budget is no
    real GPU's (a test's, a toy's) and :data:`WORKSPACE_SHARE` of it is kept (logged).

    Example:
        >>> default_workspace(80 << 30) >> 20, default_workspace(100 << 20, streams=2) >> 20
        (32, 50)
        >>> default_workspace(100_000)
        5000
    """
    want = DEFAULT_WORKSPACE * max(1, streams)
    if budget is None:
        return want
    if budget >= 2 * DEFAULT_WORKSPACE:
        return min(want, budget // 2)
    share = int(budget * WORKSPACE_SHARE)
    log.info(
        "a GPU budget of %d bytes cannot keep cuBLAS's 32 MiB workspace: the margin is %d bytes "
        "(pass workspace= for a real GPU, e.g. placement.runtime.torch.streaming.measure_workspace)",
        budget,
        share,
    )
    return share
