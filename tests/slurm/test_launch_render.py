"""`nagmoe launch slurm` without a cluster: the rendered 4 x 8-GPU script, CPU mode from the same template,
the files written into the run dir, bad input (exit 2, one line)."""
import json
import os
import re
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm

RENDER_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}


def nagmoe(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "nagmoe", *map(str, args)], capture_output=True, text=True,
                          env=env or RENDER_ENV, cwd=cwd, timeout=120)


def sbatch_options(script):
    """The `#SBATCH` directives as {option: value} (value True for flags)."""
    out = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            out[m.group(1)] = True if m.group(2) is None else m.group(2)
    return out


def write_stand_in(path, body):
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_with_stand_ins(path, tmp_path, **env_extra):
    """Run a rendered train.sbatch with stand-ins for the cluster's commands (4 nodes gpu01-04 that resolve);
    srun records its argv, after the shell expanded everything, and the flight recorder's variables it was given
    in $LOG (one JSON line per call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    write_stand_in(bin_dir / "scontrol", 'if [ "$1 $2" = "show hostnames" ]; then printf "gpu01\\ngpu02\\ngpu03\\n'
                                         'gpu04\\n"; elif [ "$1" != listpids ]; then echo "$@" >> "$LOG.scontrol"; fi\n')
    write_stand_in(bin_dir / "getent", 'echo "10.0.0.1 $2"\n')  # the nodes' names resolve (train.sbatch checks)
    write_stand_in(bin_dir / "srun", f'{sys.executable} -c "import json, os, sys; print(json.dumps([sys.argv[1:], '
                                     '{k: v for k, v in os.environ.items() if k.startswith(\'TORCH_\')}]))" '
                                     '"$@" >> "$LOG"\n')
    env = {**RENDER_ENV, "PATH": f"{bin_dir}:{RENDER_ENV['PATH']}", "LOG": str(tmp_path / "srun.log"),
           "SLURM_JOB_ID": "1234", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]", **env_extra}
    env.pop("MASTER_PORT", None)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_4_nodes_x_8_gpus_renders_the_torchrun_launch(repo_root, tmp_path):
    run_dir = tmp_path / "run"
    out = nagmoe("launch", "slurm", "--config", os.path.join(repo_root, "configs/tiny.yaml"), "--nodes", 4,
                 "--time", "2:00:00", "--partition", "gpu", "--account", "lab", "--job-name", "big",
                 "--run-dir", run_dir, "--dry-run", "train.max_steps=50")
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert not run_dir.exists()  # a dry run writes nothing
    path = tmp_path / "train.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr

    opts = sbatch_options(script)
    assert {k: opts.get(k) for k in ("nodes", "ntasks-per-node", "gpus-per-node", "time", "partition", "account",
                                     "job-name", "signal", "requeue", "exclusive")} == {
        "nodes": "4", "ntasks-per-node": "1", "gpus-per-node": "8", "time": "2:00:00", "partition": "gpu",
        "account": "lab", "job-name": "big", "signal": "B:USR1@120", "requeue": True, "exclusive": True}
    assert opts["output"].startswith(str(run_dir / "slurm") + "/")
    assert "# export NCCL_IB_HCA=" in script and "# export NCCL_SOCKET_IFNAME=" in script  # commented, overridable

    # Execute the script with stand-ins for the cluster commands (no 4-node cluster here; the local-Slurm tests
    # run the real thing on one node): record srun's argv after the shell has expanded everything.
    ran = run_with_stand_ins(path, tmp_path)
    assert ran.returncode == 0, ran.stderr
    argv = json.loads((tmp_path / "srun.log").read_text())[0]
    launcher = argv.index(next(a for a in argv if a.endswith("torchrun")))
    assert argv[:launcher] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    # the pinned config, named by its content, and its sha256 checked by `nagmoe train` (issue 41)
    sha = argv[argv.index("--config-sha256") + 1]
    assert argv[launcher + 1:] == [
        "--nnodes", "4", "--nproc_per_node", "8", "--rdzv_backend", "c10d", "--rdzv_endpoint", "gpu01:21234",
        "--rdzv_id", "1234", "-m", "nagmoe", "train", "--config", str(run_dir / "slurm" / f"config-{sha[:12]}.yaml"),
        "--run-dir", str(run_dir), "--quiet", "--progress", "lines", "--config-sha256", sha]
    assert not (tmp_path / "srun.log.scontrol").exists()  # no marker: no requeue


def test_a_gpu_job_turns_on_the_flight_recorder_into_the_run_dir_and_a_cpu_job_leaves_the_run_dir_alone(
        repo_root, tmp_path):
    """On NCCL a timed-out collective dumps each rank's last collectives (issue 51 item 4): the job exports
    torch's flight-recorder settings (both names of each) with the dump going to RUN_DIR/slurm/flight_recorder/,
    for GPU jobs (Slurm sets SLURM_GPUS_PER_NODE) only; a value the user set wins."""
    run_dir = tmp_path / "run"
    out = nagmoe("launch", "slurm", "--config", os.path.join(repo_root, "configs/tiny.yaml"), "--nodes", 4,
                 "--run-dir", run_dir, "--dry-run")
    assert out.returncode == 0, out.stderr
    path = tmp_path / "train.sbatch"
    path.write_text(out.stdout)
    (run_dir / "slurm").mkdir(parents=True)  # sbatch's log folder, made at submission

    ran = run_with_stand_ins(path, tmp_path, SLURM_GPUS_PER_NODE="8", TORCH_NCCL_DUMP_ON_TIMEOUT="0")
    assert ran.returncode == 0, ran.stderr
    _, torch_env = json.loads((tmp_path / "srun.log").read_text().splitlines()[-1])
    dump = str(run_dir / "slurm" / "flight_recorder" / "rank_")
    assert {k: torch_env.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                                          "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                                          "TORCH_NCCL_DUMP_ON_TIMEOUT")} == {
        "TORCH_FR_BUFFER_SIZE": "20000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_FR_DUMP_TEMP_FILE": dump,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump, "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}  # the user's 0 kept
    assert (run_dir / "slurm" / "flight_recorder").is_dir()  # torch writes there, it does not make the folder

    (run_dir / "slurm" / "flight_recorder").rmdir()
    ran = run_with_stand_ins(path, tmp_path)  # no GPUs in the allocation (CPU mode): nothing of it
    assert ran.returncode == 0, ran.stderr
    _, torch_env = json.loads((tmp_path / "srun.log").read_text().splitlines()[-1])
    assert not any(k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE", "TORCH_NCCL_DEBUG_INFO")) for k in torch_env)
    assert sorted(p.name for p in (run_dir / "slurm").iterdir()) == []


def test_cpu_mode_same_template_and_files_written(repo_root, tmp_path):
    from nagmoe.config import load_config

    config = os.path.join(repo_root, "configs/tiny.yaml")
    gpu = nagmoe("launch", "slurm", "--config", config, "--run-dir", tmp_path / "run", "--dry-run").stdout
    out = nagmoe("launch", "slurm", "--config", config, "--run-dir", tmp_path / "run", "--gpus-per-node", 0,
                 "--procs-per-node", 2, "train.max_steps=7")
    assert out.returncode == 0, out.stderr
    slurm_dir = tmp_path / "run" / "slurm"
    cpu = (slurm_dir / "train.sbatch").read_text()
    assert "gpus-per-node" not in sbatch_options(cpu) and sbatch_options(cpu)["cpus-per-task"] == "2"
    assert "PROCS_PER_NODE=2" in cpu and "PROCS_PER_NODE=8" in gpu

    def body(s):  # everything but the directives and the values that differ by mode
        mode_lines = ("#SBATCH", "PROCS_PER_NODE=", "# CPU mode", "# GPU mode")
        # the config differs by mode (train.device), so its pinned name and sha256 do too
        return [re.sub(r"[0-9a-f]{64}|config-[0-9a-f]{12}", "SHA", line) for line in s.splitlines()
                if not line.startswith(mode_lines)]

    assert body(cpu) == body(gpu)
    cfg = load_config(str(slurm_dir / "config.yaml"))  # the resolved config, overrides applied
    assert cfg.train.max_steps == 7 and cfg.train.device == "cpu"
    assert str(slurm_dir / "train.sbatch") in out.stdout


def test_array_dry_run_chains_tokenizer_slices_merge(repo_root, tmp_path):
    out = nagmoe("launch", "slurm", "--config", os.path.join(repo_root, "configs/tiny.yaml"), "--array", 2,
                 "--run-dir", tmp_path / "prep", "--dry-run")
    assert out.returncode == 0, out.stderr
    scripts = re.split(r"^# ===== (\S+) =====\n", out.stdout, flags=re.M)[1:]
    scripts = dict(zip(scripts[::2], scripts[1::2]))
    assert list(scripts) == ["prepare_tokenizer.sbatch", "prepare_slices.sbatch", "prepare_merge.sbatch"]
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert sbatch_options(scripts["prepare_slices.sbatch"])["array"] == "0-1"
    assert "prepare-data --config" in scripts["prepare_slices.sbatch"]
    assert scripts["prepare_slices.sbatch"].rstrip().endswith("--num-shards 2")
    assert scripts["prepare_tokenizer.sbatch"].rstrip().endswith("--tokenizer-only")
    assert scripts["prepare_merge.sbatch"].rstrip().endswith("--merge --num-shards 2")


@pytest.mark.parametrize("args, message", [
    (["--config", "no/such.yaml"], "config file not found: "),
    (["--config", "{tiny}", "--nodes", "0"], "--nodes: 0 must be >= 1"),
    (["--config", "{tiny}", "--procs-per-node", "4"], "--procs-per-node: 4 differs from --gpus-per-node 8"),
    (["--config", "{tiny}", "--array", "0"], "--array: 0 must be >= 1"),
    (["--config", "{tiny}", "--submit"], "sbatch: not found on PATH"),
])
def test_bad_input_exits_2_with_one_line(repo_root, tmp_path, args, message):
    args = [a.replace("{tiny}", os.path.join(repo_root, "configs/tiny.yaml")) for a in args]
    env = {**RENDER_ENV, "PATH": os.path.dirname(sys.executable)}  # the venv only: no sbatch on PATH
    assert not os.path.exists(os.path.join(env["PATH"], "sbatch"))
    out = nagmoe("launch", "slurm", *args, "--run-dir", tmp_path / "run", env=env)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.startswith("nagmoe launch: error: ")
    assert not (tmp_path / "run").exists()


def test_refuses_a_run_dir_with_checkpoints_of_another_config(repo_root, tmp_path):
    config = os.path.join(repo_root, "configs/tiny.yaml")
    run = tmp_path / "run"
    assert nagmoe("launch", "slurm", "--config", config, "--run-dir", run).returncode == 0
    os.replace(run / "slurm" / "config.yaml", run / "config.yaml")  # as the trainer leaves it
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    out = nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "model.d_model=64")
    assert out.returncode == 2 and "model.d_model: 128 -> 64" in out.stderr, out.stderr
    assert nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "train.max_steps=9").returncode == 0
    assert nagmoe("launch", "slurm", "--config", config, "--run-dir", run, "model.d_model=64",
                  "--accept-config-change").returncode == 0


def test_preflight_dry_run_renders_a_short_job_at_the_layout(repo_root, tmp_path):
    run_dir = tmp_path / "run"
    out = nagmoe("launch", "slurm", "--config", os.path.join(repo_root, "configs/tiny.yaml"), "--nodes", 4,
                 "--run-dir", run_dir, "--preflight", "--dry-run")
    assert out.returncode == 0, out.stderr
    opts = sbatch_options(out.stdout)
    assert opts["nodes"] == "4" and opts["gpus-per-node"] == "8" and opts["job-name"] == "nagmoe-run-preflight"
    assert "requeue" not in opts and "signal" not in opts  # a short check, not a preemptible run
    assert f"-m nagmoe preflight --dir \"$DIR\" --steps 3" in out.stdout
    assert f"DIR={run_dir}/preflight" in out.stdout and "memory estimate per rank" in out.stderr
    assert not run_dir.exists()
