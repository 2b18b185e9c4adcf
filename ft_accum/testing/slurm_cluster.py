"""A real one-node SLURM cluster for the tests: Debian's munge, slurmctld and slurmd, started in a folder.

Nothing is mocked: `sbatch`, `srun`, `scontrol requeue` and partition preemption run through the
real daemons (issue 64). `.ci/run` installs the packages as root (`apt-get install slurmctld slurmd
munge`); without them `SlurmCluster.missing()` says how to install them and the tests skip.

The daemons run in the foreground of their own processes (no systemd): munged with a key and a
socket in the folder, then `slurmctld -D` and `slurmd -D` with a generated `slurm.conf`:
proctrack/linuxproc and task/none (no cgroups), no accounting, the node named and sized by `slurmd
-C`. Two partitions share the node: `main`, and `high`, whose jobs preempt `main`'s by requeueing
them (`PreemptType=preempt/partition_prio`, `PreemptMode=REQUEUE`), after sending the job's
`--signal` (`SlurmctldParameters=preempt_send_user_signal`) and a grace time. `cred_expire=5` and
`sched_interval=1` make a requeued job run again within seconds. `stop()` ends every daemon it
started, by PID.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "munge")
COMMANDS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "squeue")
GRACE_SECONDS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """One node, two partitions (`main`, and `high` that preempts it), in `folder`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.processes: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @staticmethod
    def missing() -> str | None:
        """Why no cluster can start here (one line with the install command), or None."""
        absent = [c for c in COMMANDS if shutil.which(c) is None]
        if absent:
            return f"no {', '.join(absent)}: as root, apt-get install -y {' '.join(PACKAGES)} (as .ci/run does)"
        if os.geteuid() != 0:
            return "the test SLURM runs its daemons as root; run the tests as root (CI does)"
        return None

    def start(self, timeout: float = 30) -> SlurmCluster:
        folder = self.folder
        for sub in ("munge", "state", "spool", "logs"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(folder / "munge", 0o700)
        key = folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = folder / "munge" / "munge.socket"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={folder / 'munge' / 'munged.pid'}", f"--log-file={folder / 'logs' / 'munged.log'}",
                     f"--seed-file={folder / 'munge' / 'munged.seed'}"])  # fmt: skip
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self.conf.write_text(self._config())
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.node} idle")
        return self

    def _config(self) -> str:
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        folder = self.folder
        return "\n".join([
            "ClusterName=ftaccum", f"SlurmctldHost={self.node}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'logs' / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'logs' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "SlurmctldParameters=preempt_send_user_signal", "KillWait=30", "MinJobAge=300",
            re.sub(r" (Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=\d+", "", node) + " State=UNKNOWN",
            f"PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={GRACE_SECONDS}",
            f"PartitionName=high Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
        ]) + "\n"  # fmt: skip

    def _spawn(self, command: list[str]) -> None:
        log = open(self.folder / "logs" / f"{command[0]}.out", "w")  # noqa: SIM115  (the daemon's, for its life)
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _node_idle(self) -> bool:
        shown = self.run(["scontrol", "show", "node", self.node], check=False)
        return shown.returncode == 0 and re.search(r"State=IDLE\b", shown.stdout) is not None

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(p.read_text()[-1500:] for p in (self.folder / "logs").glob("*"))
                self.stop()
                raise RuntimeError(f"the test SLURM did not come up ({what}; exited: {dead}):\n{logs}")
            time.sleep(0.2)

    def run(self, command: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        return subprocess.run(command, env={**self.env, **kwargs.pop("env", {})}, capture_output=True, text=True,
                              check=check, **kwargs)  # fmt: skip

    def submit(self, script: Path, *options: str, env: dict | None = None) -> int:
        """`sbatch options script` → the job id."""
        out = self.run(["sbatch", "--parsable", *options, str(script)], env=env or {}).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, …); {} once the job is forgotten."""
        shown = self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def wait_for(self, job_id: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (fields := self.job(job_id)).get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {fields}")
            time.sleep(0.5)
        return fields

    def stop(self) -> None:
        """End every daemon this cluster started (their jobs' processes go with slurmd's proctrack)."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()
