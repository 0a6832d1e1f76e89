"""Launch environment (torchrun vs Slurm variables, Slurm node lists), `parallel.*` validation (exit 2 with a
message, before any process group exists), and the real `torchrun ... -m nagmoe train parallel.ep=2`."""
import os
import subprocess
import sys

import pytest

from nagmoe.config import ConfigError, load_config
from nagmoe.base.errors import UserError
from nagmoe.parallel.env import DistEnv, expand_nodelist, read_dist_env
from nagmoe.parallel.mesh import validate_parallel


@pytest.mark.parametrize("nodelist,hosts", [
    ("node07", ["node07"]),
    ("a,b", ["a", "b"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("gpu[09-10],login1", ["gpu09", "gpu10", "login1"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_torchrun_variables_win_over_slurm():
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
                         "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"})
    assert env == DistEnv(3, 4, 1, "torchrun", "h", 1234)


def test_slurm_variables_when_torchrun_is_absent():
    env = read_dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "123456"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (5, 8, 1, "slurm")
    assert env.master_addr == "gpu03"  # first host of the node list
    assert 20000 <= env.master_port < 40000  # derived from the job id: two jobs on a node do not collide
    env = read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03-04]",
                         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"})
    assert (env.master_addr, env.master_port, env.local_rank) == ("10.0.0.1", 29511, 0)


def test_single_process_and_bad_variables():
    assert read_dist_env({}) == DistEnv()
    assert not read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).distributed  # srun -n 1
    with pytest.raises(UserError, match="WORLD_SIZE"):
        read_dist_env({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(UserError, match="rank 4"):
        read_dist_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.ep=4"], 2, "parallel.ep: 4 must divide the world size (2 processes)"),
    (["parallel.ep=2"], 1, "parallel.ep: 2 must divide the world size (1 processes)"),
    (["parallel.ep=4", "model.moe.n_experts=6"], 4, "parallel.ep: 4 must divide model.moe.n_experts=6"),
    (["parallel.ep=2", "model.ffn=dense"], 2, "parallel.ep: 2 needs model.ffn=moe"),
    (["parallel.engine=deepspeed", "parallel.zero_stage=3", "train.optimizer=adamw"], 1,
     "parallel.zero_stage: 3 is not supported by parallel.engine=deepspeed"),
    (["parallel.engine=deepspeed", "parallel.zero_stage=2"], 1, "train.optimizer: 'muon' is not supported"),
    (["parallel.zero_stage=5"], 1, "parallel.zero_stage: 5 is not one of 0, 1, 2, 3"),
])
def test_validate_parallel(overrides, world, message):
    cfg = load_config(None, ["model.ffn=moe", *overrides], validate=False)  # the launch-time check alone
    with pytest.raises(ConfigError) as e:
        validate_parallel(cfg, world)
    assert str(e.value).startswith(message)
    validate_parallel(load_config(None, ["model.ffn=moe", "parallel.ep=2"]), 4)  # dp=2 x ep=2 passes


def run_cli(args, repo_root, env=None, **kw):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "nagmoe", *args], cwd=repo_root, capture_output=True, text=True,
                          env=full_env, **kw)


@pytest.mark.parametrize("override,env,message", [
    ("parallel.ep=2", {}, "parallel.ep: 2 must divide the world size (1 processes)"),
    # a torchrun-style launch of 2 ranks with ep=4: refused before any process group is created (no hang)
    ("parallel.ep=4", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "must divide the world size (2"),
    ("parallel.ep=3", {}, "parallel.ep: 3 must divide model.moe.n_experts=8"),
    ("parallel.engine=horovod", {}, "parallel.engine: 'horovod' is not one of"),
])
def test_invalid_parallel_values_exit_2(override, env, message, repo_root, tmp_path):
    r = run_cli(["train", "--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--quiet", override],
                repo_root, env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_consolidate_bad_run_dir(tmp_path):
    from nagmoe.checkpoint.consolidate import consolidate_run, load_consolidated

    with pytest.raises(UserError, match="does not exist"):
        consolidate_run(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(UserError, match="config.yaml"):
        consolidate_run(str(tmp_path / "empty"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="junk.pt"):
        load_consolidated(str(tmp_path / "junk.pt"))


@pytest.mark.distributed
def test_torchrun_train_ep2_then_consolidate(micro_overrides, repo_root, tmp_path):
    """The README line, on the micro model: torchrun, 2 gloo ranks, EP=2; then one-process consolidation."""
    import torch

    from nagmoe.checkpoint.consolidate import consolidate_run, load_consolidated_model
    from nagmoe.rundir.metrics import read_metrics

    run_dir = tmp_path / "run"
    overrides = [*micro_overrides, "train.max_steps=2", "train.eval_tokens=256"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "nagmoe", "train", "--config", "configs/tiny.yaml", "--run-dir", str(run_dir),
                        "--quiet", *overrides, "parallel.ep=2"],
                       cwd=repo_root, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(str(run_dir / "metrics.jsonl"))] == [1, 2]
    info = __import__("json").loads((run_dir / "run_info.json").read_text())
    assert (info["world_size"], info["ep"], info["dp"]) == (2, 2, 1)
    path = consolidate_run(str(run_dir))
    cfg, model = load_consolidated_model(path)
    assert model.blocks[0].ffn.w_in.shape[0] == cfg.model.moe.n_experts == 4
    with torch.no_grad():
        assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long)).logits).all()


def _wait_in_group(which: str, ep: int, repo_root: str, done_file: str):
    """Rank 1 never joins; rank 0 all-reduces on one of the mesh's groups and reports how that ended."""
    import time

    import torch
    import torch.distributed as dist

    from nagmoe.parallel.mesh import ParallelMesh

    cfg = load_config(os.path.join(repo_root, "configs", "tiny.yaml"), [f"parallel.ep={ep}"])
    mesh = ParallelMesh.build(cfg, dist.get_rank(), dist.get_world_size())
    group = {"ep": mesh.ep_group, "dp": mesh.dp_group, "ddp": mesh.ddp_group}[which]
    assert dist.get_world_size(group) == 2
    if dist.get_rank() == 1:  # hung: alive, sockets open, never in the collective (until rank 0 is done)
        deadline = time.monotonic() + 40
        while not os.path.exists(done_file) and time.monotonic() < deadline:
            time.sleep(0.2)
        return "slept"
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        outcome = "completed"
    except Exception:  # gloo: "Timed out waiting ..."
        outcome = "raised"
    seconds = time.monotonic() - started
    open(done_file, "w").close()
    return outcome, seconds


@pytest.mark.distributed
@pytest.mark.parametrize("which,ep", [("ep", 2), ("dp", 1), ("ddp", 2)])
def test_every_mesh_group_gets_the_process_group_timeout(which, ep, repo_root, tmp_path):
    """Issue 21: NAGMOE_DIST_TIMEOUT_S (here the 4 s given to init_process_group) bounds a collective on the EP,
    DP and DDP groups too, not only on the default group (torch gives new groups 30 min by default)."""
    from gloo_ranks import run_on_ranks

    results = run_on_ranks(_wait_in_group, 2, which, ep, repo_root, str(tmp_path / "done"), pg_timeout_s=4.0,
                           timeout=120)
    outcome, seconds = results[0]
    assert outcome == "raised" and 3.0 <= seconds < 20, results[0]
