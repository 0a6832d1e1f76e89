"""`nagmoe launch slurm` across hosts, for real (issue 51): a two-host Slurm cluster of network namespaces
(multihost_cluster.py; own addresses, host names and hosts files; one slurmd per host; the run dir on the shared
file system). Two hosts x two gloo ranks with the experts sharded over all four ranks (EP across hosts) train to
the same losses and weights as the same four ranks on one host; run_info.json names each rank's host; a
preemption of the two-host job checkpoints, requeues and resumes with every step logged once."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from multihost_cluster import multihost_cluster
from slurm_cluster import FINAL_STATES, wait_until
from nagmoe.rundir.metrics import read_metrics

pytestmark = pytest.mark.slurm

CPU = ("--gpus-per-node", "0", "--time", "10")
TOL = 1e-6  # fp32; the same four ranks, the same reductions in the same order on both layouts


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with multihost_cluster(tmp_path_factory.mktemp("multihost")) as cluster:
        yield cluster


def submit(cluster, config, run, nodes, procs):
    out = cluster.nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "--nodes", str(nodes),
                         "--procs-per-node", str(procs), *CPU, "--submit").stdout
    m = re.search(r"\bjob (\d+)", out)
    assert m, out
    return m.group(1)


def wait_done(cluster, job, run, timeout=300):
    info = wait_until(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(cluster.job(job)),
                      timeout, f"job {job} to finish")
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    text = open(log).read() if os.path.isfile(log) else "(no log)"
    assert info["JobState"] == "COMPLETED", f"{info.get('JobState')} {info.get('ExitCode')}:\n{text[-3000:]}"
    return info, text


def records(run):
    return [r for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "step" in r]


def final_weights(run):
    from nagmoe.eval.generate import load_run

    return load_run(run).model.state_dict()


def test_two_hosts_with_experts_across_them_equal_one_host(hosts, micro_yaml, tmp_path):
    config = micro_yaml("parallel.ep=4", "train.max_steps=10", "train.schedule_steps=10")
    runs = {}
    for name, nodes, procs in (("two_hosts", 2, 2), ("one_host", 1, 4)):
        run = str(tmp_path / name)
        _, log = wait_done(hosts, submit(hosts, config, run, nodes, procs), run)
        runs[name] = run
        with open(os.path.join(run, "run_info.json")) as f:
            info = json.load(f)
        assert info["world_size"] == 4 and info["ep"] == 4
        assert info["hosts"] == (["n1", "n1", "n2", "n2"] if nodes == 2 else ["n1"] * 4), info["hosts"]
        assert f"{nodes} node(s) x {procs} rank(s), rendezvous n1:" in log
    a, b = records(runs["two_hosts"]), records(runs["one_host"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= TOL * max(1.0, abs(rb["loss"])), (ra["step"], ra["loss"], rb["loss"])
    wa, wb = final_weights(runs["two_hosts"]), final_weights(runs["one_host"])
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=TOL, msg=key)


def test_a_preempted_two_host_job_requeues_and_resumes_every_step_once(hosts, micro_yaml, tmp_path):
    steps = 150
    run = str(tmp_path / "run")
    config = micro_yaml("parallel.ep=2", f"train.max_steps={steps}", f"train.schedule_steps={steps}",
                        "train.checkpoint_every=50")
    job = submit(hosts, config, run, 2, 1)
    wait_until(lambda: len(records(run)) >= 3 if os.path.isfile(os.path.join(run, "metrics.jsonl")) else
               hosts.job(job).get("JobState") in FINAL_STATES, 180, "three logged steps")
    hosts.client("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@T does
    wait_until(lambda: hosts.job(job).get("Restarts", "0") != "0", 120, "the job to be requeued")
    info, log = wait_done(hosts, job, run, timeout=300)
    assert info["Restarts"] == "1" and "preempted: requeueing job" in log and "(restart 1)" in log
    assert [r["step"] for r in records(run)] == list(range(1, steps + 1))  # every step exactly once


def history(run):
    path = os.path.join(run, "slurm", "restarts.tsv")
    return [line.split("\t") for line in open(path).read().splitlines()] if os.path.isfile(path) else []


def test_a_lost_host_restarts_the_job_from_its_last_checkpoint_by_itself(hosts, micro_yaml, tmp_path):
    """Every process of n2 killed mid-run (its slurmd back 5 s later, as a rebooted node's would be): the rank on
    n1 fails, srun is ended once n1's tasks are gone (NAGMOE_STEP_GRACE_S), and the batch script requeues the job,
    which resumes from the last valid checkpoint and finishes; every step is logged once."""
    steps = 100
    run = str(tmp_path / "run")
    config = micro_yaml("parallel.ep=2", f"train.max_steps={steps}", f"train.schedule_steps={steps}",
                        "train.checkpoint_every=10")
    job = submit(hosts, config, run, 2, 1)
    wait_until(lambda: os.path.isfile(os.path.join(run, "metrics.jsonl")) and len(records(run)) >= 25, 180,
               "25 logged steps")
    killed_at, before = time.monotonic(), len(records(run))
    hosts.kill_host("n2")
    time.sleep(5)
    hosts.start_slurmd("n2")
    wait_until(lambda: hosts.job(job).get("Restarts", "0") != "0", 180, "the job to be requeued")
    wait_until(lambda: len(records(run)) > before or hosts.job(job).get("JobState") in FINAL_STATES, 240,
               "a step logged after the restart")
    to_next_step = time.monotonic() - killed_at
    info, log = wait_done(hosts, job, run, timeout=300)
    assert info["Restarts"] == "1" and "requeueing job" in log, log[-3000:]
    assert [r["step"] for r in records(run)] == list(range(1, steps + 1))  # from the checkpoint, each step once
    (entry,) = history(run)
    assert entry[1] == job and entry[2] == "1" and entry[4].startswith("step_"), entry
    print(f"[figure] kill -> next logged step: {to_next_step:.1f} s")
    assert to_next_step < 120, to_next_step


def test_a_deterministic_failure_is_not_retried_beyond_the_budget(hosts, micro_yaml, tmp_path):
    """A failure that recurs before any new checkpoint (here a test hook raising at step 5, as a config or data
    error would) is retried once at most: no new checkpoint since the last restart ends the loop."""
    run = str(tmp_path / "run")
    config = micro_yaml("parallel.ep=2", "train.max_steps=40", "train.schedule_steps=40", "train.checkpoint_every=20")
    env = {"NAGMOE_TEST_HOOKS": "1", "NAGMOE_TEST_FAIL_AT_STEP": "5"}
    out = hosts.nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "--nodes", "2", "--procs-per-node",
                       "1", *CPU, "--submit", env=env).stdout
    job = re.search(r"\bjob (\d+)", out).group(1)
    info = wait_until(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(hosts.job(job)), 300,
                      f"job {job} to end")
    log = open(os.path.join(run, "slurm", f"slurm-{job}.out")).read()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", (info, log[-3000:])
    assert "no new checkpoint since the last restart (none)" in log, log[-3000:]
    assert len(history(run)) == 1


@pytest.mark.parametrize("fault", ["unresolvable", "port_in_use"])
def test_rendezvous_faults_are_one_line(hosts, micro_yaml, tmp_path, fault):
    run = str(tmp_path / "run")
    out = hosts.nagmoe("launch", "slurm", "--config", micro_yaml(), "--run-dir", run, "--nodes", "2",
                       "--procs-per-node", "1", *CPU, "--sbatch-arg=--hold", "--submit").stdout
    job = re.search(r"\bjob (\d+)", out).group(1)  # held: the fault is set up before its batch script starts
    blocker = None
    if fault == "unresolvable":
        with open(hosts.hosts_file) as f:
            saved = f.read()
        with open(hosts.hosts_file, "w") as f:  # n1 vanishes from every host's name service
            f.write("".join(line for line in saved.splitlines(True) if not line.rstrip().endswith(" n1")))
    try:
        if fault == "port_in_use":
            port = 20000 + int(job) % 20000
            blocker = subprocess.Popen(hosts.command_on("n1", sys.executable, "-c",
                                       f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); "
                                       "s.listen(); time.sleep(120)"))
            time.sleep(2)  # listening
        hosts.client("scontrol", "release", job)
        info = wait_until(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(hosts.job(job)),
                          120, f"job {job} to end")
    finally:
        if fault == "unresolvable":
            with open(hosts.hosts_file, "w") as f:
                f.write(saved)
        if blocker is not None:
            blocker.kill()
            blocker.wait()
    log = open(os.path.join(run, "slurm", f"slurm-{job}.out")).read()
    lines = [line for line in log.splitlines() if line.startswith("[nagmoe] the rendezvous")]
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), (info, log)
    assert len(lines) == 1 and "Traceback" not in log, log
    assert ("does not resolve" in lines[0]) if fault == "unresolvable" else ("is in use" in lines[0]), lines


def test_a_partitioned_host_ends_in_bounded_time_and_the_job_resumes_after_the_link_returns(hosts, micro_yaml,
                                                                                            tmp_path):
    """n2's link down mid-run, with Slurm's SlurmdTimeout (300 s) far beyond the test: only nagmoe can end it. The
    rank on n1 blocks in a collective whose peer never answers; its progress watchdog ends it with one line naming
    rank and host, and the stacks, in the job log; the batch script ends srun and requeues; once the link is back
    the job resumes from its last checkpoint and finishes, every step logged once. The cut may land in a
    checkpoint save, whose allowance (NAGMOE_HANG_LONG_PHASE_S, 900 s by default) is 20 s here."""
    steps = 100
    run = str(tmp_path / "run")
    config = micro_yaml("parallel.ep=2", f"train.max_steps={steps}", f"train.schedule_steps={steps}",
                        "train.checkpoint_every=10", "train.hang_timeout_s=8")
    out = hosts.nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "--nodes", "2", "--procs-per-node",
                       "1", *CPU, "--submit", env={"NAGMOE_STEP_GRACE_S": "5", "NAGMOE_HANG_LONG_PHASE_S": "20"}).stdout
    job = re.search(r"\bjob (\d+)", out).group(1)
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    wait_until(lambda: os.path.isfile(os.path.join(run, "metrics.jsonl")) and len(records(run)) >= 25, 180,
               "25 logged steps")
    cut_at = time.monotonic()
    hosts.partition("n2")
    try:
        line = wait_until(lambda: next((x for x in open(log).read().splitlines()
                                        if x.startswith("[nagmoe] rank 0 on n1: hung after step")), None), 180,
                          "rank 0's hung line")
        stopped_in = time.monotonic() - cut_at
    finally:
        hosts.partition("n2", down=False)
    assert "no progress for" in line and stopped_in < 180, (line, stopped_in)
    print(f"[line] {line}")
    assert "; rank 1 on n2 silent since step " in line, line  # the culprit by rank and host (issue 61)
    assert "Current thread" in open(log).read()  # the stacks of the blocked rank
    info, text = wait_done(hosts, job, run, timeout=300)
    assert int(info["Restarts"]) >= 1 and "requeueing job" in text, text[-3000:]
    assert [r["step"] for r in records(run)] == list(range(1, steps + 1))
    print(f"[figure] partition -> rank 0 stopped: {stopped_in:.1f} s")


def _rank_pid(run: str, rank: int) -> int:
    """The pid of the training process of `rank` of the job writing `run` (the hosts share this pid namespace)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"nagmoe" in cmd and b" train" in cmd.replace(b"\0", b" ") \
                and run.encode() in cmd:
            return int(pid)
    return 0


def test_a_stopped_rank_is_named_by_rank_and_host(hosts, micro_yaml, tmp_path):
    """Issue 61: rank 1 on n2 SIGSTOPped mid-run (alive, sockets open, silent). Rank 0's watchdog line names it:
    "rank 1 on n2 silent since step N", read from the heartbeats in the rendezvous store."""
    import signal

    run = str(tmp_path / "run")
    config = micro_yaml("parallel.ep=2", "train.max_steps=400", "train.schedule_steps=400",
                        "train.checkpoint_every=0", "train.hang_timeout_s=8")
    job = submit(hosts, config, run, 2, 1)
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    wait_until(lambda: os.path.isfile(os.path.join(run, "metrics.jsonl")) and len(records(run)) >= 10, 180,
               "10 logged steps")
    pid = wait_until(lambda: _rank_pid(run, 1), 30, "rank 1's process")
    os.kill(pid, signal.SIGSTOP)
    try:
        line = wait_until(lambda: next((x for x in open(log).read().splitlines()
                                        if x.startswith("[nagmoe] rank 0 on n1: hung after step")), None), 120,
                          "rank 0's hung line")
    finally:
        hosts.client("scancel", job, check=False)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: hosts.job(job).get("JobState") in FINAL_STATES, 120, f"job {job} to end")
    print(f"[line] {line}")
    assert "; rank 1 on n2 silent since step " in line and "this rank (0 on n1) last finished step" in line, line

