"""FLOP-matched experiments: one YAML file names the runs, the seeds and the one FLOP budget they all share.

    name: demo                      # run dirs land in RUNS_ROOT/NAME/RUN-sSEED/ (RUNS_ROOT defaults to runs/)
    flop_budget: 1.06703e+13        # training FLOPs of every run (the LR horizon and the stop)
    flop_convention: matmul         # optional: the unit of the budget for every run (matmul | non_embedding)
    seeds: [0]                      # each run is repeated per seed (train.seed)
    runs:
      baseline: {config: ../tiny-prenorm.yaml}
      nag:      {config: ../tiny.yaml, overrides: [model.nag.C=8]}
    overrides: [train.eval_every=50]  # optional: applied to every run, before the run's own
    report: {eval_items: 200, analysis_tokens: 16384}  # optional: what `nagmoe report` measures
    description: one line shown at the top of the report   # optional

A sweep of experiments with budgets of their own is one file that includes them: `include: [a.yaml, b.yaml]`
(paths relative to the file) instead of or beside `runs`; every included run keeps its file's `flop_budget`,
`flop_convention` and `overrides` (run names must be unique across the files), while `name`, `seeds`,
`report` and the file's own `overrides` come from the including file. `flop_budget` is then needed only for
the file's own runs.

Config paths are relative to the experiment file's folder (like `inherit:`). The resolved config of a run is
`config` + `train.flop_budget=<flop_budget>` + `train.flop_convention=<flop_convention>` (when the file sets
one) + `train.max_steps=null` + the experiment's overrides + the run's
overrides + the command line's overrides + `train.seed=<seed>`; overriding `train.flop_budget`,
`train.flop_convention` or `train.seed` anywhere is refused (the budget is what makes the runs comparable). A capped `train.max_steps` is allowed
(smoke tests) but the report then shows runs that stopped before their budget.

Locally the runs train one after another in this process (a run dir with summary.json is finished and
skipped; an unfinished one resumes from its latest checkpoint). On Slurm every run x seed is one training job
(`launch/train.sbatch`, the same script `nagmoe launch slurm` writes) and one report job waits for all of them
with `afterany`, so a failed run does not block the report of the others.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from nagmoe.config import Config, ConfigError, dump_yaml, load_config, parse_overrides, set_key, yaml_load
from nagmoe.base.errors import UserError, shown
from nagmoe.rundir.names import SUMMARY_FILE
from nagmoe.config.yaml_files import next_in_chain, read_yaml

REPORT_FILE = "report.html"
MANAGED_KEYS = ("train.flop_budget", "train.flop_convention", "train.seed")  # set by the experiment only
TOP_KEYS = ("name", "flop_budget", "flop_convention", "seeds", "runs", "include", "overrides", "report",
            "description")
RUN_KEYS = ("config", "overrides")
REPORT_KEYS = ("eval_items", "analysis_tokens")
DEFAULT_REPORT = {"eval_items": 200, "analysis_tokens": 16384}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` would let a trailing newline through


@dataclass
class RunSpec:
    name: str
    config: str  # absolute path
    overrides: list = field(default_factory=list)
    flop_budget: Optional[float] = None  # None: the experiment's (set for runs of an included file)
    flop_convention: Optional[str] = None


@dataclass
class Experiment:
    name: str
    flop_budget: Optional[float]  # None when every run comes from an included file (with its own)
    seeds: list
    runs: dict  # name -> RunSpec, in file order
    path: str
    overrides: list = field(default_factory=list)
    report: dict = field(default_factory=lambda: dict(DEFAULT_REPORT))
    description: str = ""
    flop_convention: Optional[str] = None  # None: each run's config decides (default matmul)

    def out_dir(self, runs_root: str = "runs") -> str:
        return os.path.join(runs_root, self.name)

    def plan(self, runs_root: str = "runs", only: Optional[list] = None, overrides: tuple = ()) -> list:
        """Every (run, seed) as a RunPlan with its resolved, validated config; `only` picks run names."""
        names = list(self.runs)
        if only:
            for name in only:
                if name not in self.runs:
                    raise UserError(f"--only: {shown(name)} is not a run of {self.path} ({_hint(name, names)})")
            names = [n for n in names if n in only]
        _refuse_managed(overrides, "command line override")
        plans = []
        for name in names:
            spec = self.runs[name]
            budget = spec.flop_budget if spec.flop_budget is not None else self.flop_budget
            unit = spec.flop_convention if spec.flop_budget is not None else self.flop_convention
            for seed in self.seeds:
                convention = [f"train.flop_convention={unit}"] if unit else []
                run_overrides = [f"train.flop_budget={budget:.10e}", *convention, "train.max_steps=null",
                                 *self.overrides, *spec.overrides, *overrides, f"train.seed={seed}"]
                try:
                    cfg = load_config(spec.config, run_overrides)
                except ConfigError as e:
                    raise UserError(f"{self.path}: run {name} (seed {seed}): {e}") from None
                run_dir = os.path.join(self.out_dir(runs_root), f"{name}-s{seed}")
                plans.append(RunPlan(name, seed, run_dir, cfg, spec.config, run_overrides))
        for p in plans:
            p.check_budget()
        return plans


@dataclass
class RunPlan:
    run: str
    seed: int
    run_dir: str
    config: Config
    config_path: str
    overrides: list

    @property
    def label(self) -> str:
        return f"{self.run}-s{self.seed}"

    @property
    def done(self) -> bool:
        """Finished with this config: summary.json, and the saved config equals the planned one (the device
        aside). A finished run whose budget or config changed is handed to the trainer again, which continues
        to a new budget or refuses a structural change with a message."""
        from nagmoe.rundir.info import read_saved_config, resume_differences

        if not os.path.isfile(os.path.join(self.run_dir, SUMMARY_FILE)):
            return False
        try:
            saved = read_saved_config(self.run_dir)
        except Exception:  # unreadable: let the trainer say what is wrong
            return False
        if saved is None or any(getattr(saved.train, k) != getattr(self.config.train, k)
                                for k in ("flop_budget", "max_steps")):  # the stops (resumable keys)
            return False
        return not [d for d in resume_differences(self.run_dir, self.config) if not d.startswith("train.device:")]

    def full_depth_flops_per_token(self) -> float:
        from nagmoe.config.flops import flops_per_token

        return flops_per_token(self.config.model, self.config.data.seq_len,
                               convention=self.config.train.flop_convention)

    def ideal_flops_per_token(self) -> float:
        """At the target skip rate on every sublayer (MoD), else full depth: the plan's token estimate."""
        from nagmoe.config.flops import flops_per_token

        return flops_per_token(self.config.model, self.config.data.seq_len, 1.0 - self.config.model.mod.skip_rate,
                               self.config.train.flop_convention)

    def expected_tokens(self) -> float:
        return self.config.train.flop_budget / self.ideal_flops_per_token()

    def expected_steps(self) -> float:
        return self.expected_tokens() / self.config.train.batch_tokens

    def check_budget(self) -> None:
        step = self.full_depth_flops_per_token() * self.config.train.batch_tokens
        if self.config.train.flop_budget < step:
            raise UserError(f"flop_budget: {self.config.train.flop_budget:.4g} is below one training step of run "
                            f"{self.run} ({step:.4g} FLOPs at full depth)")


# ----------------------------------------------------------------------------------------------------------
# Reading the file
# ----------------------------------------------------------------------------------------------------------
def _hint(name: str, known: list) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if len(name) <= 100 else []
    return f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known) or 'none'}"


def _check_keys(where: str, data: dict, known: tuple) -> None:
    for key in data:
        if key not in known:
            raise UserError(f"{where}: unknown key {shown(key)} ({_hint(str(key), list(known))})")


def _override_list(where: str, value) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: must be a list of 'key.sub=value' strings")
    try:
        parse_overrides(value)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None
    _refuse_managed(value, where)
    return list(value)


def _refuse_managed(overrides, where: str) -> None:
    for key, _ in parse_overrides(overrides):
        if key in MANAGED_KEYS:
            raise UserError(f"{where}: {key} is set by the experiment (flop_budget, flop_convention, seeds); remove "
                            "the override")


def _positive_number(where: str, value) -> float:
    try:  # PyYAML reads 1.2e13 (no exponent sign) as a string
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not number > 0 or number == float("inf"):
        raise UserError(f"{where}: {shown(value)} must be a positive number (training FLOPs)")
    return number


def _included_runs(path: str, folder: str, include, including: tuple = ()) -> dict:
    """The runs of the included experiment files, each with its file's budget, convention and overrides."""
    if include is None:
        return {}
    if not isinstance(include, list) or not include or not all(isinstance(i, str) for i in include):
        raise UserError(f"{path}: include: must be a non-empty list of experiment files")
    runs = {}
    for item in include:
        sub_path = os.path.normpath(os.path.join(folder, item))
        if os.path.abspath(sub_path) == os.path.abspath(path):
            raise UserError(f"{path}: include: {item} is this file")
        sub = load_experiment(sub_path, including)
        if sub.flop_budget is None and any(r.flop_budget is None for r in sub.runs.values()):
            raise UserError(f"{path}: include: {item} has no flop_budget")
        for name, spec in sub.runs.items():
            if name in runs:
                raise UserError(f"{path}: include: run {shown(name)} of {item} is also a run of an earlier file")
            own = spec.flop_budget is not None
            runs[name] = RunSpec(name, spec.config, [*sub.overrides, *spec.overrides],
                                 spec.flop_budget if own else sub.flop_budget,
                                 spec.flop_convention if own else sub.flop_convention)
    return runs


def load_experiment(path: str, _including: tuple = ()) -> Experiment:
    """Read and check an experiment file; UserError naming the file and the key on any problem. `_including`:
    the real paths of the files that include this one (a cycle is named as one, not a recursion error)."""
    real = next_in_chain(path, _including, "include")
    if not os.path.isfile(path):
        raise UserError(f"experiment file not found: {shown(path)}")
    data = read_yaml(path)  # UTF-8, bounded (nagmoe.config.yaml_files): one line on any YAML problem
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping with name, flop_budget, seeds, runs")
    _check_keys(path, data, TOP_KEYS)
    needed = ("name", "seeds") + (() if data.get("include") else ("flop_budget", "runs"))
    for key in needed:
        if key not in data:
            raise UserError(f"{path}: missing {shown(key)} (an experiment needs name, flop_budget, seeds, runs)")
    if data.get("runs") and "flop_budget" not in data:
        raise UserError(f"{path}: missing 'flop_budget' (the file's own runs need one)")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserError(f"{path}: name: {shown(name, 60)} must be one word of "
                        "letters, digits, '.', '_' or '-'")
    budget = _positive_number(f"{path}: flop_budget", data["flop_budget"]) if "flop_budget" in data else None
    convention = data.get("flop_convention")
    if convention is not None and convention not in ("matmul", "non_embedding"):
        raise UserError(f"{path}: flop_convention: {shown(convention)} must be matmul or non_embedding")
    seeds = data["seeds"]
    seeds = [seeds] if isinstance(seeds, int) and not isinstance(seeds, bool) else seeds
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2 ** 63 for s in seeds)):
        raise UserError(f"{path}: seeds: {shown(data['seeds'])} must be a non-empty list of integers in [0, 2**63)")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"{path}: seeds: {seeds} repeats a seed")
    if "runs" in data and (not isinstance(data["runs"], dict) or not data["runs"]):
        raise UserError(f"{path}: runs: must map run names to {{config: PATH, overrides: [...]}}")
    folder = os.path.dirname(os.path.abspath(path))
    runs = _included_runs(path, folder, data.get("include"), (*_including, real))
    for run_name, spec in (data.get("runs") or {}).items():
        where = f"{path}: runs.{run_name}"
        if not isinstance(run_name, str) or not _NAME.fullmatch(run_name):
            raise UserError(f"{where}: the run name must be one word of letters, digits, '.', '_' or '-'")
        if not isinstance(spec, dict) or "config" not in spec:
            raise UserError(f"{where}: must be a mapping with 'config' (and optional 'overrides')")
        _check_keys(where, spec, RUN_KEYS)
        config = os.path.normpath(os.path.join(folder, str(spec["config"])))
        if not os.path.isfile(config):
            raise UserError(f"{where}.config: {config} not found (paths are relative to the experiment file)")
        if run_name in runs:
            raise UserError(f"{where}: the name is also a run of an included file")
        runs[run_name] = RunSpec(run_name, config, _override_list(f"{where}.overrides", spec.get("overrides")))
    report = dict(DEFAULT_REPORT)
    if data.get("report") is not None:
        if not isinstance(data["report"], dict):
            raise UserError(f"{path}: report: must be a mapping ({', '.join(REPORT_KEYS)})")
        _check_keys(f"{path}: report", data["report"], REPORT_KEYS)
        for key, value in data["report"].items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"{path}: report.{key}: {shown(value)} must be an integer >= 0 (0 = skip)")
            report[key] = value
    return Experiment(name=name, flop_budget=budget, seeds=list(seeds), runs=runs, path=path,
                      overrides=_override_list(f"{path}: overrides", data.get("overrides")), report=report,
                      description=str(data.get("description") or ""), flop_convention=convention)


# ----------------------------------------------------------------------------------------------------------
# Describing, training locally, reporting
# ----------------------------------------------------------------------------------------------------------
def _budget_words(exp: Experiment) -> str:
    """"shared FLOP budget X training FLOPs (convention) per run", or the budgets of an experiment of several."""
    budgets = {}
    for spec in exp.runs.values():
        own = spec.flop_budget is not None
        key = (spec.flop_budget if own else exp.flop_budget, spec.flop_convention if own else exp.flop_convention)
        budgets.setdefault(key, []).append(spec.name)
    words = [f"{b:.6g} training FLOPs{f' ({c} convention)' if c else ''}" for b, c in budgets]
    if len(words) == 1:
        return f"shared FLOP budget {words[0]} per run"
    return "FLOP budgets " + "; ".join(f"{w} for {', '.join(names)}" for w, names in zip(words, budgets.values()))


def describe(exp: Experiment, plans: list) -> str:
    """The plan as text: the shared budget, then one line per run x seed."""
    lines = [f"experiment {exp.name} ({exp.path}): {_budget_words(exp)}; seeds {', '.join(map(str, exp.seeds))}; "
             f"{len(plans)} run(s)"]
    width = max(len(p.label) for p in plans)
    for p in plans:
        mod = p.config.model.mod.skip_rate
        lines.append(f"  {p.label:<{width}}  {os.path.relpath(p.config_path):<34} ~{p.expected_steps():,.0f} steps,"
                     f" ~{p.expected_tokens():,.0f} tokens{f' (MoD {mod:.0%}, ideal)' if mod else ''}  -> "
                     f"{p.run_dir}{'  [done]' if p.done else ''}")
    return "\n".join(lines)


def check_data(plans: list) -> None:
    """Before training anything locally: every unfinished run's data is prepared (UserError naming the first
    that is not). Slurm submissions skip this: a data-preparation job may still be producing it."""
    from nagmoe.data import shards

    for p in plans:
        index = os.path.join(p.config.data.data_dir, shards.INDEX)
        if not p.done and not os.path.isfile(index):
            raise UserError(f"run {p.label}: {index}: no prepared data; run `nagmoe prepare-data --config "
                            f"{os.path.relpath(p.config_path)}` first")


def train_local(plans: list, quiet: bool = False, log: Callable[[str], None] = print) -> dict:
    """Train the plans one after another; {label: "done" | "trained" | "failed: <message>"}. A failed run is
    reported and the next one starts (the report still shows the others)."""
    from nagmoe.train.trainer import Trainer

    status = {}
    for i, p in enumerate(plans, 1):
        if p.done:
            log(f"[experiment] {i}/{len(plans)} {p.label}: finished already ({p.run_dir}/{SUMMARY_FILE})")
            status[p.label] = "done"
            continue
        log(f"[experiment] {i}/{len(plans)} {p.label}: training {os.path.relpath(p.config_path)} -> {p.run_dir}")
        started = time.time()
        try:
            summary = Trainer(p.config, p.run_dir, quiet=quiet).run()
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # a diverged or crashed run must not stop the others
            log(f"[experiment] {p.label}: FAILED: {type(e).__name__}: {e}")
            status[p.label] = f"failed: {type(e).__name__}: {e}"
            continue
        bpb = summary.get("val_bpb")
        log(f"[experiment] {p.label}: val bpb {bpb:.4f}, {summary['tokens']:,} tokens, {summary['steps']} steps, "
            f"{time.time() - started:.0f} s")
        status[p.label] = "trained"
    return status


def report_run_dirs(exp: Experiment, runs_root: str = "runs") -> list:
    """Every run dir of the experiment (all runs and seeds, whether trained or not), in file order."""
    return [os.path.join(exp.out_dir(runs_root), f"{name}-s{seed}") for name in exp.runs for seed in exp.seeds]


def write_experiment_report(exp: Experiment, runs_root: str = "runs", device: str = "auto",
                            log: Callable[[str], None] = print) -> dict:
    from nagmoe.analysis.report import write_report

    return write_report(report_run_dirs(exp, runs_root), exp.out_dir(runs_root), title=f"experiment {exp.name}",
                        description=exp.description, eval_items=exp.report["eval_items"],
                        analysis_tokens=exp.report["analysis_tokens"], device=device, log=log)


# ----------------------------------------------------------------------------------------------------------
# Slurm
# ----------------------------------------------------------------------------------------------------------
REPORT_SCRIPT = """#!/bin/bash
# nagmoe experiment {name}: the report, after every training job has ended (afterany: failed runs included).
{sbatch_lines}

set -uo pipefail
export OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads}  # not the submitting shell's
OUT={out}
echo "[nagmoe] report of experiment {name} (job $SLURM_JOB_ID) -> $OUT"
exec {python} -m nagmoe report {run_dirs} --out {out} --title {title}{description} \\
  --eval-items {eval_items} --analysis-tokens {analysis_tokens}
"""


@dataclass
class SlurmJob:
    label: str
    run_dir: str
    script: str  # text
    path: str  # where it is (or would be) written
    config_yaml: str = ""
    job_id: Optional[str] = None


def slurm_jobs(exp: Experiment, plans: list, opts, runs_root: str = "runs",
               accept_config_change: bool = False) -> tuple:
    """(training jobs for the unfinished plans, the report job), rendered but not written."""
    from nagmoe.launch import slurm
    from nagmoe.launch.pinned_config import config_sha256

    opts.validate()
    jobs = []
    for p in plans:
        if p.done:
            continue
        cfg = p.config
        if opts.cpu_mode:  # gloo ranks on CPUs, as `nagmoe launch slurm --gpus-per-node 0`
            if cfg.train.device == "cuda":
                raise UserError(f"run {p.label}: train.device=cuda with --gpus-per-node 0 (CPU mode)")
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train))
            set_key(cfg, "train.device", "cpu")
        elif cfg.train.device == "cpu":
            raise UserError(f"run {p.label}: train.device=cpu with --gpus-per-node {opts.gpus_per_node}: use "
                            "--gpus-per-node 0 --procs-per-node K for CPU ranks")
        run_dir = os.path.abspath(p.run_dir)
        config_yaml = dump_yaml(cfg)
        slurm.check_resume_config(run_dir, config_yaml, accept_config_change)
        job_opts = dataclasses.replace(opts, job_name=f"{opts.job_name or exp.name}-{p.label}")
        script = slurm.render_train_script(job_opts, run_dir, config_sha256=config_sha256(config_yaml),
                                           accept_config_change=accept_config_change, run_dir_what="--runs-root")
        jobs.append(SlurmJob(p.label, run_dir, script, os.path.join(run_dir, slurm.SLURM_DIR, slurm.TRAIN_TEMPLATE),
                             config_yaml))
    out = os.path.abspath(exp.out_dir(runs_root))
    # every value below is shlex.quote'd in an unquoted place (the report's --out too: never inside "..."), and
    # the log directory is checked in sbatch_lines like every job's, whether or not training jobs were rendered
    lines = slurm.sbatch_lines(opts, f"{opts.job_name or exp.name}-report", os.path.join(out, slurm.SLURM_DIR),
                               "slurm-report-%j.out", log_dir_what="--runs-root",
                               gpus=0 if opts.cpu_mode else 1, cpus_per_task=opts.cpus_per_task)
    run_dirs = " ".join(shlex.quote(os.path.abspath(d)) for d in report_run_dirs(exp, runs_root))
    text = REPORT_SCRIPT.format(
        name=exp.name, sbatch_lines=lines, threads=opts.cpus_per_task or 1, out=shlex.quote(out),
        python=shlex.quote(sys.executable), run_dirs=run_dirs, title=shlex.quote(f"experiment {exp.name}"),
        description=f" --description {shlex.quote(exp.description)}" if exp.description else "",
        eval_items=exp.report["eval_items"], analysis_tokens=exp.report["analysis_tokens"])
    report = SlurmJob("report", out, text, os.path.join(out, slurm.SLURM_DIR, "report.sbatch"))
    return jobs, report


def describe_slurm(exp: Experiment, plans: list, jobs: list, report, opts) -> str:
    done = [p.label for p in plans if p.done]
    mode = (f"CPU mode, {opts.procs_per_node} gloo rank(s) per node" if opts.cpu_mode
            else f"{opts.gpus_per_node} GPU(s) per node")
    lines = [f"experiment {exp.name}: {_budget_words(exp)} (train.flop_budget of every job); {len(jobs)} training "
             "job(s) + 1 report job",
             f"  each training job: {opts.nodes} node(s), {mode}, time limit {opts.time or 'the partition default'}"
             " (requeues itself after a preemption checkpoint)"]
    for i, j in enumerate(jobs, 1):
        lines.append(f"  job {i}: train {j.label:<20} run dir {j.run_dir}  script {j.path}")
    if done:
        lines.append(f"  finished already (no job): {', '.join(done)}")
    dep = ("--dependency=afterany:" + ":".join(f"<job {i}>" for i in range(1, len(jobs) + 1))
           + " (starts when every training job has ended, succeeded or failed)") if jobs else "no dependency"
    command = re.sub(r"\s*\\\n\s*", " ", report.script.split("exec ", 1)[1]).strip()
    lines.append(f"  report job: {report.path} -> {report.run_dir}/{REPORT_FILE}; {dep}")
    lines.append(f"    {command}")
    return "\n".join(lines)


def submit_slurm(jobs: list, report, log: Callable[[str], None] = print, despite_live_job: bool = False) -> str:
    """Write and submit the training jobs, then the report job with afterany on all of them; its job id."""
    from nagmoe.launch import slurm
    from nagmoe.launch.pinned_config import check_relaunch, config_sha256, record_job

    slurm.require_sbatch()
    for j in jobs:  # before anything is written or submitted
        check_relaunch(j.run_dir, config_sha256(j.config_yaml), despite_live_job)
    os.makedirs(os.path.dirname(report.path), exist_ok=True)
    slurm.write_script(report.path, report.script)
    submitted = []
    try:
        for j in jobs:
            slurm.write_files(j.run_dir, j.config_yaml, {slurm.TRAIN_TEMPLATE: j.script})
            j.job_id = slurm.submit(j.path)
            record_job(j.run_dir, j.job_id, config_sha256(j.config_yaml))
            submitted.append(j.job_id)
            log(f"submitted job {j.job_id}: train {j.label} (run dir {j.run_dir})")
        dependency = ("afterany:" + ":".join(submitted)) if submitted else None
        report.job_id = slurm.submit(report.path, dependency)
    except UserError as e:
        if not submitted:
            raise
        raise UserError(f"{e}; already submitted: job(s) {', '.join(submitted)} (cancel with `scancel "
                        f"{' '.join(submitted)}`, or submit the report after them: `sbatch --dependency=afterany:"
                        f"{':'.join(submitted)} {report.path}`)") from None
    log(f"submitted job {report.job_id}: report -> {os.path.join(report.run_dir, REPORT_FILE)}"
        f"{f' (dependency {dependency})' if dependency else ''}")
    return report.job_id
