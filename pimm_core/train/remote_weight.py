"""A remote ``train.weight`` (``s3://...``) downloaded once per node, for all of its ranks.

Each rank reading the URL on its own (what
:func:`~pimm_core.checkpoint.weights.warm_start.warm_start` does alone) would download one copy per
rank: eight copies of the weights on a node of eight GPUs. Under a process group, the lowest
rank on each host downloads and checks the source into a temporary directory of pimm's own
(:func:`~pimm_core.checkpoint.remote.source.download`); every rank of that host warm-starts
from the copy; the directory is removed once every rank has read it (after a kill: by the next
download, :mod:`~pimm_core.checkpoint.records.scratch`). A download that fails on
any node fails every rank with the same one-line error (no rank is left waiting).
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import Any, Iterator

from ..checkpoint.records.scratch import make_owned_dir, release
from ..checkpoint.remote.source import download, plan_remote, shared_copy, store_error
from ..errors import PimmError
from ..process import dist


@contextlib.contextmanager
def node_copy(url: str, options: dict[str, Any] | None, rank: int) -> Iterator[None]:
    """Inside, reading ``url`` (any rank of this process group) uses this node's one copy.

    Every rank must enter it (collectives). Without a process group it does nothing: the
    reader downloads its own copy.

    Raises:
        PimmError: as :func:`~pimm_core.checkpoint.remote.source.plan_remote` and
            :func:`~pimm_core.checkpoint.remote.source.download`, on every rank.
    """
    hosts = dist.all_gather_object(socket.gethostname())
    if len(hosts) == 1:
        yield
        return
    leader = hosts.index(hosts[rank])  # the lowest rank on this host
    into: tuple[Path, int] | None = None
    mine: tuple[str | None, Any, PimmError | None] | None = None
    if leader == rank:
        try:
            fs, plan = plan_remote(url, options)
            into = make_owned_dir("pimm-remote-")
            mine = (str(download(fs, plan, into[0])), plan, None)
        except Exception as e:  # every rank must reach the gather below, whatever happened here
            mine = (None, None, store_error(url, e, "download"))
    try:
        gathered = dist.all_gather_object(mine)
        failed = [g[2] for g in gathered if g is not None and g[2] is not None]
        if failed:
            raise failed[0]
        copy, plan, _ = gathered[leader]
        with shared_copy(url, Path(copy), plan):
            yield
        dist.all_gather_object(None)  # every rank of the node has read the copy
    finally:
        if into is not None:
            release(*into)
