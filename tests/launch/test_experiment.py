"""Experiment files (`nagmoe/launch/experiment.py`) and `nagmoe experiment`: the file's checks, how a run's config is
resolved (shared budget, seed, overrides, run dir), the shipped experiments are FLOP-matched as their comments
say, local training skips finished runs, `--slurm --dry-run` lists the jobs, the afterany dependency and the
shared budget, and one real submission on the local Slurm test cluster (tests/support/slurm_cluster.py) ends
with its report even though one of its runs fails."""
import json
import os
import re
import subprocess
import sys

import pytest

from nagmoe.config import load_config
from nagmoe.base.errors import UserError
from nagmoe.launch.experiment import load_experiment
from nagmoe.flops import flops_per_token

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
from slurm_cluster import running_cluster  # noqa: E402


def nagmoe(*args, check=True, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "nagmoe", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout)
    if check and out.returncode != 0:
        pytest.fail(f"nagmoe {' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout[-2000:]}\n"
                    f"{out.stderr[-2000:]}")
    return out


@pytest.fixture
def micro(request, micro_data):
    """(MICRO_OVERRIDES + the shared data, the micro NAG model's FLOPs per step); the root conftest's constants
    come from its plugin (`from conftest import` gets whichever conftest.py pytest loaded last)."""
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    overrides = [o for o in root.MICRO_OVERRIDES if not o.startswith("train.max_steps")]
    overrides += [f"data.corpus={corpus}", f"data.data_dir={data_dir}"]
    cfg = load_config(TINY, overrides)
    return overrides, flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.batch_tokens


def write(path, spec):
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------------------------------------
GOOD = {"name": "x", "flop_budget": 1e12, "seeds": [0], "runs": {"nag": {"config": TINY}}}
DROP = object()  # remove the key


@pytest.mark.parametrize("change, message", [
    ({"name": DROP}, "missing 'name'"),
    ({"name": "a b"}, "name: 'a b' must be one word"),
    ({"flop_budget": -1}, "flop_budget: -1 must be a positive number"),
    ({"flop_budget": "lots"}, "flop_budget: 'lots' must be a positive number"),
    ({"seeds": []}, "seeds: [] must be a non-empty list"),
    ({"seeds": [1, 1]}, "seeds: [1, 1] repeats a seed"),
    ({"runz": {}}, "unknown key 'runz' (did you mean 'runs'?)"),
    ({"runs": {"nag": {"config": "nope.yaml"}}}, "runs.nag.config: "),
    ({"runs": {"nag": {"config": TINY, "override": []}}},
     "runs.nag: unknown key 'override' (did you mean 'overrides'?)"),
    ({"runs": {"nag": {"config": TINY, "overrides": ["train.seed=3"]}}}, "train.seed is set by the experiment"),
    ({"overrides": ["train.flop_budget=1e9"]}, "train.flop_budget is set by the experiment"),
    ({"overrides": ["no_equals"]}, "must look like key.sub=value"),
    ({"report": {"eval_items": -1}}, "report.eval_items: -1 must be an integer >= 0"),
])
def test_experiment_file_errors_name_the_problem(tmp_path, change, message):
    spec = {k: v for k, v in {**GOOD, **change}.items() if v is not DROP}
    with pytest.raises(UserError) as e:
        load_experiment(write(tmp_path / "exp.yaml", spec))
    assert message in str(e.value)


def test_plan_resolves_budget_seed_overrides_and_run_dirs(tmp_path):
    folder = tmp_path / "configs" / "experiments"
    folder.mkdir(parents=True)
    spec = {**GOOD, "flop_budget": "1.5e13", "seeds": [3, 7], "overrides": ["model.n_layers=3", "train.eval_every=7"],
            "runs": {"a": {"config": os.path.relpath(TINY, folder)},  # relative to the experiment file's folder
                     "b": {"config": TINY, "overrides": ["model.n_layers=2", "model.mod.skip_rate=0.2"]}}}
    exp = load_experiment(write(folder / "exp.yaml", spec))
    plans = exp.plan(str(tmp_path / "runs"), overrides=("train.eval_every=9",))
    assert [(p.run, p.seed) for p in plans] == [("a", 3), ("a", 7), ("b", 3), ("b", 7)]
    for p in plans:
        t = p.config.train
        assert p.run_dir == str(tmp_path / "runs" / "x" / f"{p.run}-s{p.seed}")
        assert (t.flop_budget, t.seed, t.max_steps, t.eval_every) == (1.5e13, p.seed, None, 9)  # CLI wins
    assert [p.config.model.n_layers for p in plans] == [3, 3, 2, 2]  # the run's overrides after the experiment's
    assert plans[2].expected_tokens() > plans[0].expected_tokens()  # MoD: more tokens for the same FLOPs
    with pytest.raises(UserError, match="--only: 'c' is not a run"):
        exp.plan(str(tmp_path / "runs"), only=["c"])
    with pytest.raises(UserError, match="train.seed is set by the experiment"):
        exp.plan(str(tmp_path / "runs"), overrides=("train.seed=1",))
    prenorm = {"pre": {"config": os.path.join(REPO, "configs/tiny-prenorm.yaml")}}  # no NAG warm-up check first
    small = load_experiment(write(tmp_path / "small.yaml", {**GOOD, "flop_budget": 1e9, "runs": prenorm}))
    with pytest.raises(UserError, match="below one training step of run pre"):
        small.plan(str(tmp_path / "runs"))


def steps_of(cfg, budget):
    return budget / (flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.batch_tokens)


def test_shipped_experiments_are_flop_matched_as_documented(tmp_path):
    demo = load_experiment(os.path.join(REPO, "configs/experiments/demo.yaml"))
    plans = {p.run: p for p in demo.plan(str(tmp_path))}
    assert list(plans) == ["baseline", "nag", "nag-mod20"]
    assert {p.config.train.flop_budget for p in plans.values()} == {demo.flop_budget}
    assert abs(steps_of(plans["nag"].config, demo.flop_budget) - 160) < 0.01  # 160 full-depth NAG steps
    assert (plans["baseline"].config.model.residual, plans["nag"].config.model.residual) == ("prenorm", "nag")
    assert plans["nag-mod20"].config.model.mod.skip_rate == 0.2 and plans["nag"].config.model.mod.skip_rate == 0
    # each ratio's runs share the FLOPs of its full-depth NAG model's 50B tokens, in the non_embedding convention
    sweep = load_experiment(os.path.join(REPO, "configs/experiments/sweep.yaml"))
    assert len(sweep.runs) == 9 and sweep.seeds == [0, 1, 2]
    plans = sweep.plan(str(tmp_path))
    for ratio in (80, 40, 20):
        cfg = load_config(os.path.join(REPO, f"configs/paper/nag-r{ratio}.yaml"))
        budget = 50e9 * flops_per_token(cfg.model, cfg.data.seq_len, convention="non_embedding")
        mine = [p for p in plans if p.run.endswith(f"-r{ratio}")]
        assert len(mine) == 9
        for p in mine:
            assert p.config.train.flop_budget == pytest.approx(budget, rel=1e-5)
            assert p.config.train.flop_convention == "non_embedding"
            assert (p.config.model.moe.n_experts, p.config.model.moe.top_k) == (32, 4)  # the controlled sweep
    depth = {r: load_config(os.path.join(REPO, f"configs/paper/nag-r{r}.yaml")).model.n_layers for r in (80, 40, 20)}
    assert depth[80] < depth[40] < depth[20]
    paper = load_experiment(os.path.join(REPO, "configs/experiments/paper.yaml"))
    assert {p.config.train.flop_budget for p in paper.plan(str(tmp_path))} == {
        p.config.train.flop_budget for p in plans if p.run.endswith("-r80")}
    assert paper.seeds == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------
def test_slurm_dry_run_lists_jobs_dependency_and_budget(micro, tmp_path):
    overrides, step = micro
    spec = {"name": "dry", "flop_budget": 6 * step, "seeds": [0, 1], "overrides": overrides,
            "runs": {"baseline": {"config": os.path.join(REPO, "configs/tiny-prenorm.yaml")}, "nag": {"config": TINY}}}
    path = write(tmp_path / "dry.yaml", spec)
    out = nagmoe("experiment", path, "--slurm", "--dry-run", "--gpus-per-node", "0", "--time", "10",
                 "--runs-root", tmp_path / "runs").stdout
    assert f"shared FLOP budget {6 * step:.6g} training FLOPs per run" in out
    assert "4 training job(s) + 1 report job" in out
    for i, label in enumerate(("baseline-s0", "baseline-s1", "nag-s0", "nag-s1"), 1):
        assert re.search(rf"job {i}: train {label} +run dir {tmp_path / 'runs' / 'dry' / label}", out)
    assert "--dependency=afterany:<job 1>:<job 2>:<job 3>:<job 4>" in out
    assert f"-m nagmoe report {tmp_path / 'runs' / 'dry' / 'baseline-s0'}" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_local_runs_train_once_and_resume_skips_finished_ones(micro, tmp_path):
    overrides, step = micro
    spec = {"name": "loc", "flop_budget": 4 * step, "seeds": [0], "overrides": overrides,
            "runs": {"nag": {"config": TINY}, "other": {"config": TINY}}}
    path = write(tmp_path / "loc.yaml", spec)
    root = tmp_path / "runs"
    first = nagmoe("experiment", path, "--only", "nag", "--no-report", "--quiet", "--runs-root", root).stdout
    run = root / "loc" / "nag-s0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["flop_budget"] == 4 * step and "1/1 nag-s0: training" in first
    assert not (root / "loc" / "other-s0").exists() and not (root / "loc" / "report.html").exists()
    before = (run / "metrics.jsonl").read_text()
    again = nagmoe("experiment", path, "--only", "nag", "--no-report", "--quiet", "--runs-root", root).stdout
    assert "nag-s0: finished already" in again and (run / "metrics.jsonl").read_text() == before
    # data is checked for every run before anything trains: one line, exit 2
    bad = write(tmp_path / "bad.yaml", {**spec, "overrides": [*overrides, f"data.data_dir={tmp_path / 'none'}"]})
    out = nagmoe("experiment", bad, "--runs-root", tmp_path / "runs2", check=False)
    assert out.returncode == 2 and "no prepared data" in out.stderr and not (tmp_path / "runs2").exists()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (tests/support/slurm_cluster.py) for this module; skipped only when the binaries
    are missing and CI is unset."""
    with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.mark.slurm
def test_slurm_submission_runs_and_reports_even_when_a_run_fails(slurm_cluster, micro, tmp_path):
    overrides, step = micro
    spec = {"name": "sl", "flop_budget": 6 * step, "seeds": [0], "overrides": [*overrides, "log.every=1"],
            "report": {"eval_items": 8, "analysis_tokens": 512},
            "runs": {"nag": {"config": TINY},
                     "broken": {"config": TINY, "overrides": [f"data.data_dir={tmp_path / 'no-data'}"]}}}
    path = write(tmp_path / "sl.yaml", spec)
    root = tmp_path / "runs"
    out = slurm_cluster.nagmoe("experiment", path, "--slurm", "--gpus-per-node", "0", "--time", "10",
                               "--runs-root", root).stdout
    train = {label: job for job, label in re.findall(r"submitted job (\d+): train (\S+)", out)}
    report = re.search(r"submitted job (\d+): report .*\(dependency afterany:(\d+):(\d+)\)", out)
    assert report and set(report.groups()[1:]) == set(train.values()), out
    exp_dir = root / "sl"
    slurm_cluster.wait_job(report.group(1), timeout=300, log=exp_dir / "slurm" / f"slurm-report-{report.group(1)}.out")
    # afterany: the report ran although one training job failed (its data dir does not exist)
    assert slurm_cluster.job(train["nag-s0"])["JobState"] == "COMPLETED"
    assert slurm_cluster.job(train["broken-s0"])["JobState"] == "FAILED"
    data = json.loads((exp_dir / "report.json").read_text())
    assert list(data["runs"]) == ["nag-s0"] and data["runs"]["nag-s0"]["val_bpb"] is not None
    assert any(str(root / "sl" / "broken-s0") in p and "left out" in p for p in data["problems"])
    html = (exp_dir / "report.html").read_text()
    assert 'id="problems"' in html and "broken-s0" in html and (exp_dir / "figures" / "loss_curves.png").is_file()
