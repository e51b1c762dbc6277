"""A real one-node SLURM cluster on localhost, for tests: `slurmctld` + `slurmd`, all state in a temp dir.

    with SlurmCluster(tmp_dir) as cluster:
        proc = cluster.run(["srun", "-n2", "hostname"], timeout=60)

Needs root (slurmd starts jobs as any user) and Debian's `slurmctld`, `slurmd` and `slurm-client`
(`.ci/run` installs them); `SlurmCluster.unavailable()` says why a machine cannot run it. The
configuration avoids everything a bare container lacks: no munge (`auth/none`, `cred/none`), no
cgroups or systemd (`proctrack/linuxproc`, `task/none`). The node advertises 4 CPUs whatever the
machine has (`config_overrides`), so `srun -n2` fits on a 2-core machine. A requeued job may
start again only after `cred_expire` + 1 s (Slurm's default 120 s; 5 s here), at the next pass
of the main scheduling loop (`sched_interval`, default 60 s; 1 s here: backfill skips its passes
when nothing changed), so a requeue test takes seconds, not minutes. The daemons run
in the foreground as children of this process and are stopped by their process ids, never by name.
Every wait is bounded.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

from helpers import free_port

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "scontrol")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
NODE = "localhost"  # resolves everywhere; the coordinator JAX derives from the node list is this host


class SlurmCluster:
    def __init__(self, root: Path, cpus: int = 4, start_timeout: float = 30):
        self.root = Path(root)
        self.cpus = cpus
        self.start_timeout = start_timeout
        self.conf = self.root / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen] = {}

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot run the cluster, or None if it can."""
        if os.geteuid() != 0:
            return "starting slurmd needs root"
        missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
        if missing:
            return f"SLURM binaries not installed: {', '.join(missing)} (Debian: slurmctld slurmd slurm-client)"
        return None

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (srun, sinfo, ...): this cluster's configuration."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # A random first job id: the coordinator port follows from the job id (jaxdp.cluster.detect.slurm_port),
        # so two clusters running at once (parallel test sessions) are unlikely to pick the same port.
        first_job_id = random.randrange(1, 4096)
        self.conf.write_text(f"""\
ClusterName=jaxdp-test
SlurmctldHost={NODE}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=5
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={first_job_id}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def start(self) -> "SlurmCluster":
        self.write_config()
        log = open(self.root / "log" / "daemons.out", "ab")
        # -D: stay in the foreground, so the process we started is the daemon; -i: ignore old state.
        commands = {"slurmctld": ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                    "slurmd": ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)]}
        try:
            for name, command in commands.items():
                self._daemons[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                       env=self.env, start_new_session=True)
            self._wait_for_idle_node()
        except BaseException:
            self.stop()
            raise
        finally:
            log.close()
        return self

    def _wait_for_idle_node(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        state = ""
        while time.monotonic() < deadline:
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {daemon.returncode}; see {self.root}/log")
            probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                   env=self.env, timeout=10)
            state = probe.stdout.strip()
            if probe.returncode == 0 and state.rstrip("*") == "idle":
                return
            time.sleep(0.2)
        raise TimeoutError(f"the SLURM node was not idle within {self.start_timeout} s "
                           f"(last state {state!r}); see {self.root}/log")

    def run(self, command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run a client command (srun, sbatch, ...) against this cluster."""
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **kwargs.pop("env", {})}, **kwargs)

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as `scontrol show job` gives them (JobState, Restarts, ExitCode, ...)."""
        show = self.run(["scontrol", "-o", "show", "job", job_id], timeout=10).stdout
        return dict(item.split("=", 1) for item in show.split() if "=" in item)

    def wait_for_job(self, job_id: str, timeout: float) -> tuple[str, str]:
        """(JobState, ExitCode) once the job has ended. Polls quickly: `sbatch --wait` backs off
        to several seconds between polls, which more than doubled a 10 s test."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in ENDED:
                return fields["JobState"], fields.get("ExitCode", "")
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} did not end within {timeout} s")

    def stop(self) -> None:
        """Stop the daemons this object started (by process id), slurmd first."""
        for name in reversed(list(self._daemons)):
            daemon = self._daemons.pop(name)
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=10)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
