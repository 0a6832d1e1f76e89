"""Issue 41, the submitted config is pinned: launch writes it as RUN_DIR/slurm/config-<sha12>.yaml and the script
trains that file, so a later launch on the run dir (another config) leaves what an earlier job trains unchanged;
submitted job ids go to slurm/jobs.jsonl, and submitting another config while one of them is queued (squeue) is
refused (exit 2, nothing written) unless --despite-live-job; without squeue a warning says so and launch goes on.
sbatch and squeue are stand-in executables on PATH (the cluster's binaries; none of our code is replaced)."""
import hashlib
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def nagmoe(*args, path=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "nagmoe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def stand_ins(folder, queued=None):
    """A folder with `sbatch` (answers job 101, then 102, ...) and, when `queued` is given, `squeue` listing
    those job ids."""
    folder.mkdir()
    counter = folder / "count"
    counter.write_text("100")
    (folder / "sbatch").write_text(f'#!/bin/sh\nread n < {counter}\nn=$((n + 1))\necho $n > {counter}\necho "$n"\n')
    os.chmod(folder / "sbatch", 0o755)
    if queued is not None:
        (folder / "squeue").write_text("#!/bin/sh\n" + "".join(f"echo {j}\n" for j in queued))
        os.chmod(folder / "squeue", 0o755)
    return str(folder)


def launch(run_dir, *overrides, path=None, extra=()):
    return nagmoe("launch", "slurm", "--config", TINY, "--run-dir", run_dir, "--gpus-per-node", 0, *extra,
                  *overrides, path=path)


def launch_here(capsys, monkeypatch, run_dir, *overrides, path=None, extra=()):
    """An accepted launch, in this process (a subprocess only where the exit status is the point): (code, out, err)."""
    from nagmoe.cli import main

    if path is not None:
        monkeypatch.setenv("PATH", path)
    code = main(["launch", "slurm", "--config", TINY, "--run-dir", str(run_dir), "--gpus-per-node", "0", *extra,
                 *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def pinned_of(script_text):
    return re.search(r'CONFIG="\$RUN_DIR/slurm/(config-[0-9a-f]{12}\.yaml)"', script_text).group(1)


def test_a_later_launch_leaves_an_earlier_jobs_config_unchanged(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    assert launch_here(capsys, monkeypatch, run_dir, "train.seed=5")[0] == 0
    slurm = run_dir / "slurm"
    first = pinned_of((slurm / "train.sbatch").read_text())
    first_text = (slurm / first).read_text()
    assert launch_here(capsys, monkeypatch, run_dir, "train.seed=9")[0] == 0
    second = pinned_of((slurm / "train.sbatch").read_text())
    assert second != first and (slurm / first).read_text() == first_text  # the first job still trains its own
    for name in (first, second):
        assert hashlib.sha256((slurm / name).read_bytes()).hexdigest()[:12] == name[len("config-"):-len(".yaml")]
    assert "seed: 5" in first_text and "seed: 9" in (slurm / second).read_text()


def test_another_config_is_refused_while_a_job_is_queued(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    path = stand_ins(tmp_path / "bin", queued=["101", "555"])
    code, out, err = launch_here(capsys, monkeypatch, run_dir, "train.seed=5", path=path, extra=["--submit"])
    assert code == 0 and "submitted job 101" in out, err
    (record,) = [json.loads(line) for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert record["job_id"] == "101"
    before = sorted(os.listdir(run_dir / "slurm"))

    refused = launch(run_dir, "train.seed=9", path=path, extra=["--submit"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "101" in refused.stderr and "--despite-live-job" in refused.stderr and refused.stderr.count("\n") == 1
    assert sorted(os.listdir(run_dir / "slurm")) == before  # nothing written

    assert launch_here(capsys, monkeypatch, run_dir, "train.seed=5", path=path, extra=["--submit"])[0] == 0  # same
    code, out, err = launch_here(capsys, monkeypatch, run_dir, "train.seed=9", path=path,
                                 extra=["--submit", "--despite-live-job"])
    assert code == 0 and "submitted job 103" in out, err


def test_without_squeue_a_warning_says_so_and_launch_goes_on(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    path = stand_ins(tmp_path / "bin")  # sbatch only
    assert launch_here(capsys, monkeypatch, run_dir, "train.seed=5", path=path, extra=["--submit"])[0] == 0
    code, out, err = launch_here(capsys, monkeypatch, run_dir, "train.seed=9", path=path, extra=["--submit"])
    assert code == 0 and "squeue is not available" in err and "101" in err, err
