"""A real multi-host Slurm cluster on one machine for the launch tests (issue 51 item 1).

Each host is a network namespace of its own with its own address on a private subnet (10.201.S.0/24, S drawn
per cluster), its own host name (UTS namespace) and a hosts file bind-mounted over /etc/hosts (mount namespace);
the hosts hang on a bridge that lives in a namespace of its own ("the switch"), so no address is ever added
outside the namespaces made here. slurmctld runs on host `ctl`, one `slurmd -N NAME` on each compute host;
munged runs once and its socket (a file) is shared by every host, as is the file system (the run dir).

A host can be killed (every process in its namespace), partitioned (its link down) and brought back. Everything
is torn down by pid and namespace deletion, also when a test fails. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN):
`available()` says why not; under CI=true a missing capability is a failure, elsewhere a skip.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from slurm_cluster import (COMMON_CONF, LEAKY_ENV, SBIN_DIRS, _alive, find_binary, first_job_id, missing_binaries,
                           wait_until)

SLURM_CONF = """\
ClusterName=nagmoemh
SlurmctldHost=ctl({ctl_addr})
SlurmUser=root
SlurmdUser=root
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
SlurmdTimeout={slurmd_timeout}
MessageTimeout=5
KillWait=10
""" + COMMON_CONF + """\
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""


def available() -> str | None:
    """None when this machine can build the cluster, else why not."""
    missing = missing_binaries()
    if missing:
        return f"Slurm/munge binaries not found: {', '.join(missing)}"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter"):
        if not find_binary(tool):
            return f"{tool} not found (iproute2, util-linux)"
    probe = f"nmprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()[:200]}"
    return None


class MultiHostSlurm:
    """`hosts` compute hosts (n1, n2, ...) and `ctl`, each a namespace (module docstring). `env` is what the
    clients and submitted jobs see; `on(host, *cmd)` runs a command on a host."""

    def __init__(self, root, hosts=("n1", "n2"), cpus=4, slurmd_timeout=300):
        self.root, self.hosts, self.cpus, self.slurmd_timeout = str(root), tuple(hosts), cpus, slurmd_timeout
        self.tag = f"nm{os.getpid() % 10000}{random.randrange(100):02d}"  # namespace and link names: <= 15 chars
        self.subnet = f"10.201.{random.randrange(1, 250)}"
        self.addr = {"ctl": f"{self.subnet}.1", **{h: f"{self.subnet}.{11 + i}" for i, h in enumerate(self.hosts)}}
        self.conf = os.path.join(self.root, "slurm.conf")
        self.hosts_file = os.path.join(self.root, "hosts")
        env = {k: v for k, v in os.environ.items() if not LEAKY_ENV.match(k)}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", ""), *SBIN_DIRS])
        env.update(SLURM_CONF=self.conf, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NAGMOE_REQUEUE_POLL_S="4")
        self.env = env
        self._namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def link(self, host: str) -> str:
        return f"{self.tag}{host}"  # the host's end; the switch's end adds "s"

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "MultiHostSlurm":
        r = self.root
        for d in ("state", "spool", "munge", "log"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        for h in self.hosts:
            os.makedirs(os.path.join(r, "spool", h), exist_ok=True)
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addr.items()))
        self._network()
        self._munge()
        nodes = "\n".join(f"NodeName={h} NodeAddr={self.addr[h]} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN"
                          for h in self.hosts)
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(root=r, ctl_addr=self.addr["ctl"], slurmd_timeout=self.slurmd_timeout,
                                      nodes=nodes, node_list=",".join(self.hosts), first_job_id=first_job_id()))
        self.on("ctl", find_binary("slurmctld"))
        for h in self.hosts:
            self.start_slurmd(h)
        wait_until(lambda: self.idle_nodes() == set(self.hosts), 90,
                   f"nodes {', '.join(self.hosts)} to become idle (logs in {r}/log)")
        return self

    def _ip(self, *args, check=True):
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
        return r

    def _network(self):
        sw = self.ns("sw")
        for host in ("sw", "ctl", *self.hosts):
            self._ip("netns", "add", self.ns(host))
            self._namespaces.append(self.ns(host))
            self._ip("-n", self.ns(host), "link", "set", "lo", "up")
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw, "link", "set", "br0", "up")
        for host in ("ctl", *self.hosts):
            end, peer = self.link(host), self.link(host) + "s"
            self._ip("link", "add", end, "netns", self.ns(host), "type", "veth", "peer", "name", peer, "netns", sw)
            self._ip("-n", sw, "link", "set", peer, "master", "br0")
            self._ip("-n", sw, "link", "set", peer, "up")
            self._ip("-n", self.ns(host), "addr", "add", f"{self.addr[host]}/24", "dev", end)
            self._ip("-n", self.ns(host), "link", "set", end, "up")

    def _munge(self):
        r = self.root
        os.chmod(os.path.join(r, "munge"), 0o755)
        key = os.path.join(r, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        subprocess.run([find_binary("munged"), "--force", f"--socket={r}/munge/munge.socket.2", f"--key-file={key}",
                        f"--log-file={r}/log/munged.log", f"--pid-file={r}/munged.pid", f"--seed-file={r}/munge/seed"],
                       check=True, capture_output=True, timeout=30)

    def start_slurmd(self, host: str):
        self.on(host, find_binary("slurmd"), "-N", host)

    def stop(self):
        with contextlib.suppress(Exception):
            jobs = self.client("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
            if jobs:
                self.client("scancel", *jobs, check=False, timeout=10)
        for ns in reversed(self._namespaces):  # every process of every host, then the namespace itself
            self._kill_namespace(ns)
            self._ip("netns", "del", ns, check=False)
        self._namespaces.clear()
        path = os.path.join(self.root, "munged.pid")
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                pid = int(f.read().strip())
            os.kill(pid, signal.SIGTERM)

    def _kill_namespace(self, ns: str):
        for _ in range(3):
            pids = [int(p) for p in self._ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
            pids = [p for p in pids if p != os.getpid()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.05)

    # -- faults ----------------------------------------------------------------------------------------
    def kill_host(self, host: str):
        """Every process on `host` killed at once (slurmd, the step, torchrun, the ranks): a host lost."""
        self._kill_namespace(self.ns(host))

    def partition(self, host: str, down: bool = True):
        """`host`'s link down (its processes live on, cut off) or back up."""
        self._ip("-n", self.ns(host), "link", "set", self.link(host), "down" if down else "up")

    # -- running things --------------------------------------------------------------------------------
    def command_on(self, host: str, *cmd) -> list[str]:
        """argv running `cmd` on `host`: its namespace, its host name, its hosts file."""
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, which slurmd needs
        return ["nsenter", f"--net=/var/run/netns/{self.ns(host)}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", script, self.hosts_file, host, *[str(c) for c in cmd]]

    def on(self, host: str, *cmd, check=True, timeout=60, env=None):
        r = subprocess.run(self.command_on(host, *cmd), env={**self.env, **(env or {})}, capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            pytest.fail(f"on {host}: {' '.join(map(str, cmd))} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        return r

    def client(self, *cmd, **kw):
        """A Slurm client (sbatch, squeue, scontrol, ...) run on the controller's host."""
        return self.on("ctl", *cmd, **kw)

    def nagmoe(self, *args, check=True, timeout=120, env=None):
        return self.client(sys.executable, "-m", "nagmoe", *args, check=check, timeout=timeout, env=env)

    def idle_nodes(self) -> set:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=15).stdout.split("\n")
        return {line.split()[0] for line in out if line.split()[1:2] == ["idle"]}

    def job(self, job_id) -> dict:
        out = self.client("scontrol", "-o", "show", "job", str(job_id), check=False, timeout=15)
        if out.returncode != 0:
            return {}
        return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


@contextlib.contextmanager
def multihost_cluster(root, **kw):
    """A started MultiHostSlurm under `root`, torn down on exit; skips when this machine cannot build one, fails
    under CI=true (where .ci/run installs what it needs and runs as root)."""
    why = available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (CI is set: the multi-host tests must run)")
        pytest.skip(why)
    cluster = MultiHostSlurm(root, **kw)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
