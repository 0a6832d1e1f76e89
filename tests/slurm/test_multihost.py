"""`nagmoe launch slurm` across hosts, for real (issue 51): a two-host Slurm cluster of network namespaces
(multihost_cluster.py; own addresses, host names and hosts files; one slurmd per host; the run dir on the shared
file system). Two hosts x two gloo ranks with the experts sharded over all four ranks (EP across hosts) train to
the same losses and weights as the same four ranks on one host; run_info.json names each rank's host; a
preemption of the two-host job checkpoints, requeues and resumes with every step logged once."""
import json
import os
import re

import pytest
import torch

from multihost_cluster import multihost_cluster
from slurm_cluster import FINAL_STATES, wait_until
from nagmoe.train.metrics import read_metrics

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
    steps = 300
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
