"""A real one-node SLURM for the ``slurm`` tests: munge with its own key, slurmctld and slurmd,
started in a temporary folder with a generated ``slurm.conf`` and stopped (exactly the daemons
started here, by their PIDs) at the end of the session.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` packages (SLURM 22.05);
``.ci/run`` installs them. Without them, or not as root (``SlurmUser=root``: the daemons run as
root, as the CI does), the tests skip with the reason.

The cluster is set up for tests that take seconds (see :data:`SETTINGS`): ``KillWait`` 10 s (the
real default is 30 s), ``cred_expire`` 10 s, which is also how long a requeued job waits before it
may start again (the real default, 120 s: slurm.conf(5), ``AuthInfo``), a scheduling pass every
second (``sched_interval``, default 60 s: a requeued job starts at the first pass after its wait), and the time-limit and
``--signal`` checks every 30 s as everywhere (slurmctld's fixed period: a ``--signal=SIG@N`` comes
up to 30 s earlier than N seconds before the limit, never later).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: the binaries the cluster needs (Debian: slurmctld, slurmd, slurm-client, munge)
BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scontrol", "scancel")

#: settings that differ from SLURM's defaults, for short tests (defaults in the comments)
SETTINGS = {
    "KillWait": 10,  # default 30 s: SIGTERM -> SIGKILL at a time limit, scancel, scontrol requeue
    "MinJobAge": 600,  # default 300 s: how long a finished job stays visible to scontrol
    "cred_expire": 10,  # default 120 s: also the wait of a requeued job before it starts again
    "sched_interval": 1,  # default 60 s: the periodic scheduling pass that starts a requeued job once it may
}


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    absent = [name for name in BINARIES if shutil.which(name) is None]
    if absent:
        return (
            f"SLURM not installed ({', '.join(absent)} missing): apt-get install slurmctld slurmd slurm-client "
            "munge (.ci/run does)"
        )
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root (SlurmUser=root, as in CI)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """A finished (or current) job as ``scontrol show job`` describes it."""

    id: str
    fields: dict[str, str]

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))


@dataclass
class SlurmCluster:
    """A running one-node cluster (``localhost``, 2 CPUs) whose configuration is ``conf``.

    Attributes:
        root: its temporary folder (state, spool, logs, munge key and socket).
        env: the environment for its clients (``SLURM_CONF``) on top of this process's.
    """

    root: Path
    conf: Path
    env: dict[str, str]
    pids: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(
        self, *command: str, check: bool = True, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, ...) against this cluster; its output as text."""
        return subprocess.run(
            list(command), env={**self.env, **(env or {})}, capture_output=True, text=True, check=check, timeout=60
        )

    def sbatch(self, script: Path, *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit ``script`` (``sbatch ARGS SCRIPT``) with ``env`` on top of the cluster's; its job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        if done.returncode:
            raise AssertionError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> Job:
        """``scontrol show job JOB`` parsed (``Key=Value`` pairs)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job).stdout
        return Job(job, dict(re.findall(r"(\w+)=(\S*)", out)))

    def wait(
        self,
        job: str,
        until: str | tuple[str, ...] = (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "PREEMPTED",
        ),
        timeout: float = 300,
        restarts: int | None = None,
    ) -> Job:
        """Wait until ``job`` is in a state of ``until`` (and, if given, has been requeued ``restarts``
        times); its description. Raises AssertionError on timeout, with the cluster's logs' tails."""
        states = (until,) if isinstance(until, str) else until
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.state in states and (restarts is None or info.restarts >= restarts):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job}: still {info.state} (restarts {info.restarts}) after {timeout} s, "
                    f"waiting for {states}\n{self.logs()}"
                )
            time.sleep(0.25)

    def logs(self, lines: int = 20) -> str:
        """The tails of the daemons' logs, for a failure's message."""
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel this cluster's jobs (their steps run under slurmstepd, which outlives slurmd), then
        stop the daemons started here, by their PIDs: SIGTERM, then SIGKILL after 10 s."""
        if self.pids.get("slurmctld") is not None and self.pids["slurmctld"].poll() is None:
            jobs = self.run("squeue", "--noheader", "--format=%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run("squeue", "--noheader", check=False).stdout.strip():
                    time.sleep(0.25)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.pids.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def start(root: Path, timeout: float = 60) -> SlurmCluster:
    """Start munge, slurmctld and slurmd in ``root`` (a new folder) and wait until ``sinfo`` shows the
    node idle. Raises RuntimeError (with the logs) if it does not come up in ``timeout`` seconds; the
    daemons started so far are stopped first."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # munged refuses a key or socket in a folder others can write
    for name in ("state", "spool", "munge"):
        (root / name).mkdir(exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    s = SETTINGS
    conf.write_text(f"""\
ClusterName=genolongtest
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={s["cred_expire"]}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval={s["sched_interval"]}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait={s["KillWait"]}
MinJobAge={s["MinJobAge"]}
JobRequeue=1
InactiveLimit=0
OverTimeLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in list(env):  # a test session started inside a SLURM job must not submit into it
        if name.startswith(("SLURM_", "SBATCH_", "SRUN_")) and name != "SLURM_CONF":
            del env[name]
    cluster = SlurmCluster(root=root, conf=conf, env=env)
    log = open(root / "daemons.out", "ab")
    try:
        cluster.pids["munged"] = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--log-file={root / 'munge' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
            ],
            stdout=log,
            stderr=log,
            env=env,
        )
        _until(lambda: sock.exists(), timeout, "munged's socket", cluster)
        cluster.pids["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(conf)], stdout=log, stderr=log, env=env
        )
        cluster.pids["slurmd"] = subprocess.Popen(
            ["slurmd", "-D", "-N", "localhost", "-f", str(conf)], stdout=log, stderr=log, env=env
        )
        _until(lambda: _idle(cluster), timeout, "the node idle in sinfo", cluster)
    except BaseException:
        cluster.stop()
        raise
    finally:
        log.close()
    return cluster


def _idle(cluster: SlurmCluster) -> bool:
    done = cluster.run("sinfo", "--noheader", "--Node", "--format=%t", check=False)
    return done.returncode == 0 and done.stdout.strip() == "idle"


def _until(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [name for name, proc in cluster.pids.items() if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            out = (cluster.root / "daemons.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"test SLURM: no {what} ({'exited: ' + ', '.join(dead) if dead else 'timed out'})\n"
                f"{out}\n{cluster.logs()}"
            )
        time.sleep(0.2)
