"""Every name in a run dir, in one table (issue 54): the run dir is the interface between train, eval, report,
launch and export, so its names are defined here and nowhere else. These names are a contract (DESIGN.md):
users, scripts and old run dirs rely on them; never rename one.

    RUN_DIR/
      config.yaml       CONFIG_FILE      the resolved config the run trains (rundir/info.py)
      run_info.json     RUN_INFO_FILE    provenance: hosts, git commit, versions, backends (rundir/info.py)
      metrics.jsonl     METRICS_FILE     one JSON object per logged step (rundir/metrics.py)
      summary.json      SUMMARY_FILE     the final numbers (rundir/info.py)
      eval_windows.json EVAL_WINDOWS_FILE the final eval's loss per validation window (eval/val_windows.py)
      lease.json        LEASE_FILE       which trainer owns the run dir now (rundir/lease.py)
      wandb_id          WANDB_ID_FILE    the W&B run id, so a restart continues the same W&B run
      preempt.request   REQUEST_FILE     a preemption asked for from outside (train/preemption.py)
      preempted.json    MARKER_FILE      a stop with a checkpoint: run again to continue
      checkpoints/      CHECKPOINTS      step_NNNNNN/ each (the format inside: checkpoint/files.py)
      milestones/       MILESTONES       step_NNNNNN/ each: weights only, never resumed from (checkpoint/milestone.py)
      hf/               EXPORT_DIR       the Hugging Face export written at the end of training
      slurm/            SLURM_DIR        pinned configs (config.yaml, config-SHA.yaml), jobs.jsonl, job scripts, logs
        jobs.jsonl      JOBS_FILE        one line per submitted job (launch/pinned_config.py)
      preflight/        PREFLIGHT_DIR    `nagmoe launch slurm --preflight`: its own slurm/, run/ and summary.json
        run/            PREFLIGHT_RUN_DIR
"""
CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
EVAL_WINDOWS_FILE = "eval_windows.json"
LEASE_FILE = "lease.json"
WANDB_ID_FILE = "wandb_id"
REQUEST_FILE = "preempt.request"
MARKER_FILE = "preempted.json"
CHECKPOINTS = "checkpoints"
MILESTONES = "milestones"
EXPORT_DIR = "hf"
SLURM_DIR = "slurm"
JOBS_FILE = "jobs.jsonl"
PREFLIGHT_DIR = "preflight"
PREFLIGHT_RUN_DIR = "run"

# What a finished or interrupted run leaves besides its checkpoints: a fresh start into a run dir holding any of
# these would mix two runs' histories (checkpoint/resume.py refuses it).
HISTORY_FILES = (METRICS_FILE, RUN_INFO_FILE, SUMMARY_FILE, EVAL_WINDOWS_FILE)
