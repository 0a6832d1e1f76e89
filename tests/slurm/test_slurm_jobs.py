"""`nagmoe launch slurm --submit` on a real single-node Slurm (fixture `slurm_cluster`): CPU-mode training
with 2 gloo ranks to summary.json; preemption by USR1 to the batch shell -> checkpoint -> requeue -> resume
with every step logged once; the data-preparation array (tokenizer, 2 slices, merge) equals one pass."""
import json
import os
import re

import numpy as np
import pytest

from slurm_cluster import FINAL_STATES, wait_until
from nagmoe.rundir.metrics import read_metrics

pytestmark = pytest.mark.slurm

CPU_MODE = ("--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "--time", "10")


def submit(cluster, *args, env=None):
    out = cluster.nagmoe("launch", "slurm", *args, "--submit", env=env)
    return out.stdout


def job_id(stdout, step="job"):
    m = re.search(rf"\b{step} (\d+)", stdout)
    assert m, stdout
    return m.group(1)


def logged_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r["step"] for r in read_metrics(path) if "step" in r] if os.path.isfile(path) else []


def test_submit_cpu_mode_two_ranks_trains_to_summary(slurm_cluster, micro_yaml, tmp_path):
    run = str(tmp_path / "run")
    stdout = submit(slurm_cluster, "--config", micro_yaml(), "--run-dir", run, *CPU_MODE)
    job = job_id(stdout)
    assert f"run dir {run}" in stdout
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    slurm_cluster.wait_job(job, timeout=180, log=log)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 20 and summary["tokens"] == 20 * 256
    with open(os.path.join(run, "run_info.json")) as f:
        assert json.load(f)["world_size"] == 2  # torchrun started 2 ranks on the node
    assert logged_steps(run) == list(range(1, 21))
    text = open(log).read()
    assert "1 node(s) x 2 rank(s)" in text
    # the job log shows progress (issue 67 item 7): plain lines from rank 0, the first and last step at least, each
    # with an ETA, throttled (log.every=1 here, at most one line per 10 s between them), no tqdm frames
    progress = [ln for ln in text.splitlines() if ln.startswith("[nagmoe] step ")]
    assert progress and progress[0].startswith("[nagmoe] step 1/20 ") and \
        progress[-1].startswith("[nagmoe] step 20/20 "), text[-3000:]
    assert all(" ETA " in ln for ln in progress) and len(progress) < 20, progress
    assert "\r" not in text


@pytest.mark.scale  # CI runs the same path on two hosts (test_multihost.py's preemption test); issue 50 item 4
def test_usr1_to_the_batch_shell_checkpoints_requeues_and_resumes(slurm_cluster, micro_yaml, tmp_path):
    steps = 400  # long enough that the signal lands mid-run
    run = str(tmp_path / "run")
    config = micro_yaml(f"train.max_steps={steps}", f"train.schedule_steps={steps}")
    job = job_id(submit(slurm_cluster, "--config", config, "--run-dir", run, *CPU_MODE))
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    wait_until(lambda: len(logged_steps(run)) >= 3 or slurm_cluster.job(job).get("JobState") in FINAL_STATES,
               180, "three logged steps")
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 does
    # the batch shell requeues the job; it starts again after cred_expire and runs to the end
    wait_until(lambda: slurm_cluster.job(job).get("Restarts", "0") != "0", 120, "the job to be requeued")
    info = slurm_cluster.wait_job(job, timeout=240, log=log)
    assert info["Restarts"] == "1"
    text = open(log).read()
    stopped = int(re.search(r'stopped with a checkpoint: .*"step": (\d+)', text).group(1))
    assert 3 <= stopped < steps
    assert "preempted: requeueing job" in text and "(restart 1)" in text
    with open(os.path.join(run, "run_info.json")) as f:
        assert json.load(f)["resumed_from"].endswith(f"step_{stopped:06d}")
    assert logged_steps(run) == list(range(1, steps + 1))  # every step exactly once
    with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["steps"] == steps
    assert not os.path.exists(os.path.join(run, "preempted.json"))


def test_usr1_requeues_even_when_the_marker_never_becomes_visible(slurm_cluster, micro_yaml, tmp_path):
    """Issue 21: the marker written by rank 0 may be invisible to the batch shell (another node's write behind an
    NFS cache) or missing (a save slower than the signal window): the job is requeued anyway, because only
    summary.json (a finished run) stops a requeue. The test hook keeps the trainer from writing the marker."""
    steps = 400
    run = str(tmp_path / "run")
    config = micro_yaml(f"train.max_steps={steps}", f"train.schedule_steps={steps}")
    job = job_id(submit(slurm_cluster, "--config", config, "--run-dir", run, *CPU_MODE,
                        env={"NAGMOE_TEST_MARKER_DELAY_S": "3600", "NAGMOE_TEST_HOOKS": "1"}))
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    wait_until(lambda: len(logged_steps(run)) >= 3 or slurm_cluster.job(job).get("JobState") in FINAL_STATES,
               180, "three logged steps")
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait_until(lambda: slurm_cluster.job(job).get("Restarts", "0") != "0", 120, "the job to be requeued")
    info = slurm_cluster.wait_job(job, timeout=240, log=log)
    assert info["Restarts"] == "1"
    text = open(log).read()
    assert "stopped with a checkpoint" not in text and "preempted: requeueing job" in text
    with open(os.path.join(run, "run_info.json")) as f:
        resumed_from = json.load(f)["resumed_from"]
    assert resumed_from is not None  # the preemption checkpoint was saved; only the marker was missing
    assert logged_steps(run) == list(range(1, steps + 1))  # every step exactly once


def test_scancel_checkpoints_but_does_not_requeue(slurm_cluster, micro_yaml, tmp_path):
    steps = 2000  # never reached: the job is cancelled
    run = str(tmp_path / "run")
    config = micro_yaml(f"train.max_steps={steps}", f"train.schedule_steps={steps}")
    job = job_id(submit(slurm_cluster, "--config", config, "--run-dir", run, *CPU_MODE))
    log = os.path.join(run, "slurm", f"slurm-{job}.out")
    wait_until(lambda: len(logged_steps(run)) >= 3 or slurm_cluster.job(job).get("JobState") in FINAL_STATES,
               180, "three logged steps")
    slurm_cluster.run("scancel", job)  # TERM to the batch shell and to every rank
    wait_until(lambda: os.path.isfile(log) and "not requeued" in open(log).read(), 90,
               "the batch script to finish after scancel")
    info = slurm_cluster.wait_job_state(job, "CANCELLED", timeout=60)
    assert info["Restarts"] == "0"
    with open(os.path.join(run, "preempted.json")) as f:
        marker = json.load(f)
    assert marker["reason"] == "SIGTERM" and 3 <= marker["step"] < steps
    assert os.path.isdir(marker["checkpoint"])  # a resubmission resumes from here


def split_stream(data_dir, split):
    from nagmoe.data.shards import read_index

    index = read_index(data_dir)
    return np.concatenate([np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"])
                           for r in index["shards"] if r["split"] == split])


def test_data_prep_array_of_two_slices_and_merge_equals_one_pass(slurm_cluster, micro_data, micro_config, tmp_path):
    from nagmoe.config import dump_yaml
    from nagmoe.data.prepare import prepare_single
    from nagmoe.data.shards import read_index
    from nagmoe.data.tokenizer import file_sha256

    _, corpus = micro_data
    lines = open(corpus).read().splitlines(keepends=True)
    (tmp_path / "corpus").mkdir()
    for name, part in (("a.jsonl", lines[:30]), ("b.jsonl", lines[30:])):  # slices are whole files
        (tmp_path / "corpus" / name).write_text("".join(part))

    def config(data_dir):
        return micro_config(f"data.corpus={tmp_path / 'corpus'}", f"data.data_dir={data_dir}",
                            "data.val_fraction=0.1")

    arrayed, single = str(tmp_path / "arrayed"), str(tmp_path / "single")
    (tmp_path / "prep.yaml").write_text(dump_yaml(config(arrayed)))
    stdout = submit(slurm_cluster, "--config", str(tmp_path / "prep.yaml"), "--array", "2",
                    "--run-dir", str(tmp_path / "launch"))
    tokenizer, slices, merge = (job_id(stdout, f"{step} job") for step in ("tokenizer", "slices", "merge"))
    logs = tmp_path / "launch" / "slurm"
    slurm_cluster.wait_job(merge, timeout=240, log=str(logs / f"slurm-{merge}.out"))
    for job in (tokenizer, slices):  # the merge ran after (afterok) both earlier steps succeeded
        assert slurm_cluster.job(job)["JobState"] == "COMPLETED"
    assert sorted(p.name for p in logs.glob(f"slurm-{slices}_*.out")) == [f"slurm-{slices}_0.out",
                                                                          f"slurm-{slices}_1.out"]

    prepare_single(config(single))
    assert file_sha256(os.path.join(arrayed, "tokenizer.json")) == file_sha256(os.path.join(single, "tokenizer.json"))
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_stream(arrayed, split), split_stream(single, split))
    a, b = read_index(arrayed), read_index(single)
    for split in ("train", "val"):  # shards may be cut differently (each slice ends its own last shard)
        assert [a["totals"][split][k] for k in ("n_tokens", "n_documents")] == \
            [b["totals"][split][k] for k in ("n_tokens", "n_documents")]
    assert a["vocab_size"] == b["vocab_size"]
    assert not os.path.exists(os.path.join(arrayed, "parts"))


def test_preflight_job_gives_a_verdict_naming_a_layout_that_cannot_fit(slurm_cluster, micro_yaml, tmp_path):
    """`nagmoe launch slurm --preflight --submit` in CPU mode (2 gloo ranks, EP 2): the job trains, saves,
    resumes, probes the collectives and checks the layout's CUDA estimate against a 0.001 GB GPU: FAIL,
    naming the memory check; everything else passes. The run dir's own training state is not touched."""
    run = str(tmp_path / "run")
    stdout = submit(slurm_cluster, "--config", micro_yaml("parallel.ep=2"), "--run-dir", run, *CPU_MODE,
                    "--preflight", "--preflight-steps", "2", "--gpu-memory", "0.001")
    job = job_id(stdout, "preflight job")
    info = wait_until(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(slurm_cluster.job(job)),
                      240, "the preflight job")
    log = open(os.path.join(run, "preflight", "slurm", f"slurm-{job}.out")).read()
    assert info["JobState"] == "FAILED" and "nagmoe preflight: FAIL — 2 rank(s), ep 2" in log, log[-3000:]
    with open(os.path.join(run, "preflight", "summary.json")) as f:
        summary = json.load(f)
    assert {c["name"]: c["ok"] for c in summary["checks"]} == {
        "training steps": True, "save and resume": True, "memory fits": False, "measured peak vs estimate": True}
    assert "FAIL  memory fits" in log and "the layout does not fit" in log
    assert not os.path.exists(os.path.join(run, "checkpoints"))  # the run itself is untouched
