"""A one-node Slurm cluster on localhost for the ``slurm`` tests: munged, slurmctld and slurmd
(Debian's ``munge`` and ``slurm-wlm``, installed by ``.ci/run``), each a child of the test
process, with every file (key, socket, config, state, spool, logs) under one temporary
directory; clients find it through ``SLURM_CONF``.

In CI (``CI=true``) a cluster that cannot start fails the test; elsewhere it skips with
the reason. Needs root (slurmd starts jobs as their user; SlurmdUser=root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _helpers import free_port, hang_s

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol", "scancel")
START_TIMEOUT = hang_s(60)


def unavailable(reason: str) -> None:
    """Fail under CI (the cluster is part of the suite there), else skip with ``reason``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the Slurm test cluster is not available in CI: {reason}")
    pytest.skip(f"no Slurm test cluster: {reason}")



@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # SLURM_CONF for the clients
    procs: list[subprocess.Popen]

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            base_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``base_env``, default this process's, plus ``SLURM_CONF``)."""
        r = subprocess.run(list(argv), env={**(os.environ if base_env is None else base_env), **self.env},
                           capture_output=True, text=True,
                           timeout=hang_s(timeout))
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stdout}{r.stderr}\n{self.logs()}")
        return r

    def logs(self) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", "root", check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def slurm_conf(root: Path, cpus: int) -> str:
    return f"""\
ClusterName=pimmtest
SlurmctldHost=localhost
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
KillWait=60
MinJobAge=600
NodeName=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: Path) -> Cluster:
    """Start munged, slurmctld and slurmd under ``root``; returns once ``sinfo`` shows the node idle."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if missing:
        unavailable(f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; .ci/run does)")
    if os.geteuid() != 0:
        unavailable("slurmd must run as root here (SlurmdUser=root)")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, cpus=2))
    env = {"SLURM_CONF": str(conf)}
    full_env = {**os.environ, **env}
    sbin = lambda b: shutil.which(b) or f"/usr/sbin/{b}"  # noqa: E731
    cluster = Cluster(root, env, [])
    daemons = ([sbin("munged"), "-F", "-f", f"--key-file={key}", f"--socket={root}/munge.sock",
                f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log", f"--seed-file={root}/munge.seed"],
               [sbin("slurmctld"), "-D", "-i"], [sbin("slurmd"), "-D"])
    try:
        for argv in daemons:
            out = open(root / "log" / f"{Path(argv[0]).name}.out", "w")
            cluster.procs.append(subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            if Path(argv[0]).name == "munged":
                _wait(lambda: (root / "munge.sock").exists(), "munged's socket", cluster)
        _wait(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip() == "idle",
              "sinfo to show the node idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(ready, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = cluster.logs() + "".join(f"\n--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
                                            for f in (cluster.root / "log").glob("*.out"))
            cluster.stop()
            unavailable(f"{', '.join(dead) or 'a daemon'} {'exited' if dead else 'did not get ready'} waiting for "
                        f"{what}:\n{logs}")
        time.sleep(0.2)
