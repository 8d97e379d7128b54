"""A one-node SLURM cluster on this machine, from Debian's packages (``slurm-wlm``, ``munge``), for
the slow tests: ``munged`` on a private socket and key, then ``slurmctld`` and ``slurmd``, each a
child process of the test with every file under one temporary folder. ``SLURM_CONF`` in the
environment points ``sbatch``, ``squeue``, ``scancel`` (and submitit) at it.

    with SlurmCluster(tmp_path) as cluster:      # or the ``slurm_cluster`` fixture
        subprocess.run(["sbatch", "--wrap", "hostname"], env=cluster.env)

The node declares more CPUs than this machine has (``SlurmdParameters=config_overrides``), so a
master and two workers, one CPU each, run at once on 2 cores, as on any shared node.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def missing() -> list[str]:
    """The programs this cluster needs that are not installed."""
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 16) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _write(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (r / "munge").chmod(0o700)
        self.conf.write_text(f"""\
ClusterName=diloco-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / 'munge' / 'munge.socket'}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=20
InactiveLimit=0
MinJobAge=300
NodeName={self.host} CPUs={self.cpus} RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _start(self, *cmd: str) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "ab")
        self.procs.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def __enter__(self) -> "SlurmCluster":
        self._write()
        r = self.root / "munge"
        self._start(_which("munged"), "--foreground", "--force", f"--socket={r / 'munge.socket'}",
                    f"--key-file={r / 'munge.key'}", f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                    f"--seed-file={r / 'munged.seed'}")
        self._wait(lambda: (r / "munge.socket").exists(), "munged's socket")
        self._start(_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf))
        self._start(_which("slurmd"), "-D", "-c", "-f", str(self.conf))
        self._wait(self._idle, "the node to be idle in sinfo")
        return self

    def _idle(self) -> bool:
        out = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated")

    def _wait(self, ok, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                                 for p in sorted((self.root / "log").glob("*")) if p.is_file())
                raise RuntimeError(f"SLURM test cluster: no {what} ({'exited: ' + str(dead) if dead else 'timeout'})\n{logs}")
            time.sleep(0.5)

    def jobs(self) -> list[tuple[str, str, str]]:
        """``(job id, name, state)`` of every job squeue shows."""
        out = subprocess.run([_which("squeue"), "-h", "-o", "%i|%j|%T"], env=self.env, capture_output=True, text=True)
        return [tuple(line.split("|", 2)) for line in out.stdout.splitlines() if line.count("|") == 2]  # type: ignore[misc]

    def __exit__(self, *exc) -> None:
        subprocess.run([_which("scancel"), "--full", "-u", "root"], env=self.env, capture_output=True)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
