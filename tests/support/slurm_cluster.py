"""A real single-node Slurm cluster for the launch tests (recipe: shared/reference/environment.md).

`LocalSlurm` (behind the session fixture `slurm_cluster` in conftest.py) starts munged + slurmctld + slurmd
under a temporary folder, with free ports picked at run time, `CPUs=4` (four ranks may share two cores) and
`cred_expire=5` (a requeued job may start again after 6 s instead of 121 s), and stops each daemon by its
pid file. Also the helpers the tests share: polling with a timeout, free ports, micro-config overrides.
"""
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")  # the daemons live here, often off a user's PATH
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
# Variables a surrounding launcher may have set that would leak into the test jobs.
LEAKY_ENV = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_|RANK$|WORLD_SIZE$|LOCAL_RANK$|MASTER_ADDR$|MASTER_PORT$"
                       r"|TORCHELASTIC_)")


def find_binary(name):
    return shutil.which(name) or next((os.path.join(d, name) for d in SBIN_DIRS
                                       if os.access(os.path.join(d, name), os.X_OK)), None)


def missing_binaries():
    return [b for b in DAEMONS + CLIENTS if find_binary(b) is None]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout, what, interval=0.2):
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# What every test cluster shares (this single-node one and multihost_cluster.py's): munge authentication with
# 5 s credentials, the controller's files under the cluster's root, plugins a container can run (no cgroups, no
# accounting), a node's CPU count taken from the config (four ranks may share two cores).
COMMON_CONF = """\
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket.2,cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/log/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
# a requeued job waits for its begin time (cred_expire + 1 s); the default 60 s scheduling pass would add
# up to a minute on top, so schedule every second
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
# job ids of this cluster's own range: the batch script's rendezvous port is 20000 + job id % 20000, and two test
# clusters running at once (make test's two lanes) would otherwise both give job 2 the port 20002 on 127.0.0.1
FirstJobId={first_job_id}
"""


def first_job_id() -> int:
    """A random start for a test cluster's job ids (COMMON_CONF): 1000-18999, in steps of 100."""
    import random

    return random.randrange(10, 190) * 100

SLURM_CONF = """\
ClusterName=nagmoetest
SlurmctldHost=localhost
SlurmUser={user}
SlurmdUser={user}
SlurmdSpoolDir={root}/spool
SlurmdPidFile={root}/slurmd.pid
SlurmdLogFile={root}/log/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
""" + COMMON_CONF + """\
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """munged + slurmctld + slurmd under `root`; `env` is what clients and submitted jobs should see."""

    def __init__(self, root):
        self.root = str(root)
        self.conf = os.path.join(self.root, "slurm.conf")
        env = {k: v for k, v in os.environ.items() if not LEAKY_ENV.match(k)}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", ""), *SBIN_DIRS])
        # NAGMOE_REQUEUE_POLL_S: how long a preempted batch script looks for summary.json before requeueing
        # (60 s on a cluster for NFS caches; here the run dir is local)
        env.update(SLURM_CONF=self.conf, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NAGMOE_REQUEUE_POLL_S="4")
        self.env = env

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self):
        import getpass

        r = self.root
        for d in ("state", "spool", "munge", "log"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        os.chmod(os.path.join(r, "munge"), 0o755)
        key = os.path.join(r, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # munged wants a private key file
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self.run(find_binary("munged"), "--force", f"--socket={r}/munge/munge.socket.2", f"--key-file={key}",
                 f"--log-file={r}/log/munged.log", f"--pid-file={r}/munged.pid", f"--seed-file={r}/munge/seed")
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(root=r, user=getpass.getuser(), ctld_port=free_port(),
                                      slurmd_port=free_port(), first_job_id=first_job_id()))
        self.run(find_binary("slurmctld"))
        self.run(find_binary("slurmd"), "-N", "localhost")  # the host name does not match NodeName
        wait_until(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", 60,
                   f"the Slurm node to become idle (logs in {r}/log)")
        return self

    def stop(self):
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        for name in ("slurmd", "slurmctld", "munged"):  # each by its own pid file
            path = os.path.join(self.root, f"{name}.pid")
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    # -- clients ---------------------------------------------------------------------------------------
    def run(self, *cmd, check=True, timeout=60, env=None):
        out = subprocess.run([str(c) for c in cmd], env={**self.env, **(env or {})}, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            pytest.fail(f"{' '.join(map(str, cmd))} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def nagmoe(self, *args, check=True, timeout=120, env=None):
        return self.run(sys.executable, "-m", "nagmoe", *args, check=check, timeout=timeout, env=env)

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is forgotten."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if out.returncode != 0:
            return {}
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)

    def wait_job(self, job_id, timeout, log=None):
        """Poll until the job reaches a final state; fail (with the log's tail) unless it COMPLETED."""
        info = wait_until(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(self.job(job_id)),
                          timeout, f"job {job_id} to finish")
        if info["JobState"] != "COMPLETED":
            tail = open(log).read()[-3000:] if log and os.path.isfile(log) else "(no log)"
            pytest.fail(f"job {job_id} ended {info['JobState']} (exit {info.get('ExitCode')}):\n{tail}")
        return info

    def wait_job_state(self, job_id, state, timeout):
        return wait_until(lambda: (lambda j: j if j.get("JobState") == state else None)(self.job(job_id)), timeout,
                          f"job {job_id} to reach {state}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True



# mha keeps the micro model independent of the CCA head constraints; log every step (metrics are polled)
SLURM_MICRO = ("model.attention.kind=mha", "log.every=1")


@contextlib.contextmanager
def running_cluster(root):
    """A started LocalSlurm under `root`, stopped on exit; skips when the binaries are missing, fails when
    they are missing under CI (where .ci/run installs them)."""
    missing = missing_binaries()
    if missing:
        message = f"Slurm/munge binaries not found: {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: .ci/run must install slurmctld slurmd slurm-client munge)")
        pytest.skip(f"{message}; apt-get install slurmctld slurmd slurm-client munge")
    cluster = LocalSlurm(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
