"""The launcher flags (``--nproc-per-node``, ``--nnodes``, rendezvous), as torchrun takes them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import UsageError

_RENDEZVOUS = ("rdzv_endpoint", "rdzv_backend", "master_addr", "master_port")


@dataclass
class LaunchOptions:
    """Launcher flags passed through to torchrun (names as torchrun spells them)."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None  # torchrun's elastic agent restarts the ranks this often after a rank fails
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf: KEY=VALUE,... of the rendezvous (RDZV_CONF_KEYS)

    @classmethod
    def recorded(cls, record: dict | None, given: "LaunchOptions") -> "LaunchOptions":
        """``given`` flags, with the ones not given taken from a recorded launch
        (:func:`pimm_core.run.provenance.launch_record`; ``node_rank`` is never recorded: it differs per node).
        ``--nnodes 1`` given drops the recorded rendezvous flags: the run resumes on this node alone."""
        record = record or {}
        if given.nnodes is not None and given.single_node():
            # resumed on one node: the recorded rendezvous (another node's address) does not apply
            record = {k: v for k, v in record.items() if k not in _RENDEZVOUS}
        values = {}
        for name in cls.__dataclass_fields__:
            value = getattr(given, name)
            values[name] = value if value is not None or name == "node_rank" else record.get(name)
        return cls(**values)

    def record(self) -> dict:
        """What ``pimm resume`` needs to start the same ranks again (None fields left out)."""
        return {"launcher": "pimm", **{k: v for k, v in self.__dict__.items() if v is not None and k != "node_rank"}}

    def check(self) -> None:
        """Raises UsageError for flag values torchrun would misread (e.g. ``--nproc-per-node 0``)."""
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1 (got {self.nproc_per_node})")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port must be a TCP port between 1 and 65535 (got {self.master_port})")
        if self.node_rank is not None and self.node_rank < 0:
            raise UsageError(f"--node-rank must be 0 or more (got {self.node_rank})")
        if self.rdzv_endpoint is not None:
            port = str(self.rdzv_endpoint).rpartition(":")[2] if ":" in str(self.rdzv_endpoint) else ""
            if port and not (port.isdigit() and 1 <= int(port) <= 65535):
                raise UsageError(f"--rdzv-endpoint must be HOST[:PORT] with a port between 1 and 65535 "
                                 f"(got {self.rdzv_endpoint!r})")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be 0 or more (got {self.max_restarts})")
        if self.nnodes is not None:
            parts = str(self.nnodes).split(":")
            if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
                raise UsageError(f"--nnodes must be N or MIN:MAX with N >= 1 (got {self.nnodes!r})")
        if self.rdzv_conf is not None:
            check_rdzv_conf(self.rdzv_conf, self.rdzv_backend)

    def check_rdzv_conf_applies(self) -> None:
        """Raises UsageError for a ``--rdzv-conf`` given to a launch that starts no torchrun (one process on
        one node, no restarts: pimm trains in its own process, and nothing would read it)."""
        if self.rdzv_conf is not None and not self.wants_spawn():
            raise UsageError("--rdzv-conf sets torchrun's rendezvous, and this launch starts none (one process on "
                             "one node): drop it, or start ranks with --nproc-per-node N, --nnodes or --max-restarts K")

    def world_size(self) -> int:
        """Ranks in all (the largest node count for ``MIN:MAX``)."""
        return (self.nproc_per_node or 1) * int(str(self.nnodes or "1").split(":")[-1])

    def describe(self) -> str:
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in self.__dict__.items() if v is not None]
        return f"world size {self.world_size()}" + (f" ({' '.join(flags)})" if flags else "")

    def single_node(self) -> bool:
        return self.nnodes in (None, "1", "1:1")

    def wants_spawn(self) -> bool:
        return (self.nproc_per_node or 1) > 1 or not self.single_node() or bool(self.max_restarts)

    @staticmethod
    def shutdown_timeout() -> float:
        """Seconds the ranks get to finish a stop before they are killed (``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``)."""
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600"))

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node or 1),
                "--max-restarts", str(self.max_restarts or 0)]
        # After forwarding a stop signal torchrun waits this long before SIGKILLing the ranks:
        # leave time to finish the accumulation window and save `last` (torchrun's default is 30 s).
        args += ["--shutdown-timeout", os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")]
        for flag, value in (("--nnodes", self.nnodes), ("--node-rank", self.node_rank),
                            ("--rdzv-endpoint", self.rdzv_endpoint), ("--rdzv-backend", self.rdzv_backend),
                            ("--master-addr", self.master_addr), ("--master-port", self.master_port),
                            ("--rdzv-conf", self.rdzv_conf)):
            if value is not None:
                args += [flag, str(value)]
        if not any(v is not None for v in (self.rdzv_endpoint, self.master_addr, self.nnodes)):
            args.append("--standalone")  # single node: torchrun picks a free port
        return args


def strip_launcher_flags(argv: list[str]) -> list[str]:
    """Remove torchrun-level flags (and their values) from ``launch`` arguments."""
    flags = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend",
             "--master-addr", "--master-port", "--max-restarts", "--rdzv-conf"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


#: The ``--rdzv-conf`` keys torch's own rendezvous backends read, and what each value must be: the
#: dynamic rendezvous of ``c10d`` (``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``,
#: ``create_handler``: seconds, the keep-alive beat every ``keep_alive_interval`` s and a node's loss
#: seen after ``keep_alive_max_attempt`` missed beats), its store (``c10d_rendezvous_backend.py``) and
#: ``static``'s store timeout (``static_tcp_rendezvous.py``). torch ignores any other key silently.
RDZV_CONF_KEYS = {
    "join_timeout": "seconds", "last_call_timeout": "seconds", "close_timeout": "seconds",
    "heartbeat_timeout": "seconds", "keep_alive_interval": "seconds", "keep_alive_max_attempt": "count",
    "cas_backoff_max_seconds": "float", "read_timeout": "seconds", "is_host": "bool", "store_type": "tcp|file",
    "timeout": "seconds",
}
_BOOLS = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # torch's RendezvousParameters.get_as_bool


def check_rdzv_conf(text: str, backend: str | None = None) -> dict[str, str]:
    """``--rdzv-conf KEY=VALUE,...`` parsed as torchrun parses it, with its keys and values checked.

    Args:
        text: e.g. ``"last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"``.
        backend: ``--rdzv-backend``; for one other than torch's ``c10d`` and ``static`` (``etcd``, a
            registered one) the keys are not checked (its own keys), only the syntax.

    Returns:
        ``{key: value}`` (strings, as torch gets them).

    Raises:
        UsageError: not ``KEY=VALUE`` pairs; a key torch's rendezvous does not read (it would be ignored
            silently: a misspelt key keeps torch's default wait); a value that is not what the key takes
            (a positive whole number of seconds, a count >= 1, ``cas_backoff_max_seconds`` >= 0, a boolean,
            ``tcp``/``file``).
    """
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config  # torchrun's own parser

    try:
        conf = _parse_rendezvous_config(text)
    except ValueError as e:
        raise UsageError(f"--rdzv-conf must be KEY=VALUE,... (got {text!r}: {e})") from None
    if backend not in (None, "c10d", "static"):
        return conf
    for key, value in conf.items():
        kind = RDZV_CONF_KEYS.get(key)
        if kind is None:
            raise UsageError(f"--rdzv-conf: {key!r} is not a key torch's rendezvous reads (it would be ignored); "
                             f"use {', '.join(RDZV_CONF_KEYS)}")
        if not _valid(kind, value):
            want = {"seconds": "a whole number of seconds >= 1", "count": "a whole number >= 1",
                    "float": "a number of seconds >= 0", "bool": "true or false"}.get(kind, kind)
            raise UsageError(f"--rdzv-conf: {key} must be {want} (got {value!r})")
    return conf


def _valid(kind: str, value: str) -> bool:
    if kind in ("seconds", "count"):
        return value.isdigit() and int(value) >= 1
    if kind == "float":
        try:
            return math.isfinite(float(value)) and float(value) >= 0
        except ValueError:
            return False
    if kind == "bool":
        return value.lower() in _BOOLS
    return value.strip().lower() in kind.split("|")
