"""Resuming a run dir with another config: refused (exit 2, one line listing each changed key with its old and
new value, nothing in the run dir touched) unless only the schedule-length keys changed (DESIGN:
train.max_steps, train.flop_budget, train.eval_every, train.checkpoint_every); `--accept-config-change` overrides."""
import json
import os

from nagmoe.config import RESUMABLE_KEYS, load_config
from nagmoe.train.trainer import Trainer
from trainer_processes import logged_steps, run_trainer


def snapshot(run_dir):
    """Every file of the run dir with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, run_dir)] = f.read()
    return out


def resumed_from(run_dir):
    with open(os.path.join(run_dir, "run_info.json")) as f:
        return json.load(f)["resumed_from"]


def test_config_drift_refuses_listing_the_keys_and_force_overrides(short_config, tmp_path):
    run_dir = str(tmp_path / "run")
    Trainer(load_config(short_config, ["train.max_steps=2"]), run_dir, quiet=True).run()
    before = snapshot(run_dir)

    refused = run_trainer(short_config, run_dir, "train.max_steps=4", "model.d_model=48", "train.lr_matrix=0.01")
    message = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in message and "Traceback" not in message, refused.stderr
    assert message.startswith("nagmoe train: error: ") and "config.yaml" in message and "--accept-config-change" in message
    assert "model.d_model: 32 -> 48" in message and "train.lr_matrix: 0.02 -> 0.01" in message
    assert "train.max_steps:" not in message  # a schedule-length key is not a difference
    assert snapshot(run_dir) == before  # refused before anything was written

    # every schedule-length, checkpoint-keeping and logging key changed at once: resumes without --accept-config-change
    cfg = load_config(short_config, ["train.max_steps=4", "train.flop_budget=1e15", "train.eval_every=2",
                                     "train.checkpoint_every=1", "train.keep_checkpoints=3", "log.wandb=off",
                                     "train.checkpoint_every_minutes=60", "train.keep_milestone_every_tokens=512",
                                     "train.hang_timeout_s=600", "train.eval_tokens_during=128",
                                     "train.eval_sample=first", "train.gc_every=7", "data.prefetch=1", "train.sync_every=3",
                                     "train.checkpoint_async=on", "train.milestone_dtype=fp32"])
    assert {"train.max_steps", "train.flop_budget", "train.eval_every", "train.checkpoint_every",
            "train.keep_checkpoints", "log.wandb", "train.checkpoint_every_minutes",
            "train.keep_milestone_every_tokens", "train.export_hf_at_end",
            "model.moe.bias_update_rate", "train.hang_timeout_s", "train.eval_tokens_during", "train.eval_sample",
            "train.gc_every", "data.prefetch", "train.sync_every", "train.checkpoint_async",
            "train.milestone_dtype"} == set(RESUMABLE_KEYS)
    # (the export at the end, the bias's rate: issues 42, 43; the watchdog's limit: issue 51; what the evals measure:
    # issue 66; the collector and the read-ahead: issue 67; background saves and what a milestone keeps: issue 68)
    trainer = Trainer(cfg, run_dir, quiet=True)
    assert trainer.progress.step == 2
    trainer.run()
    assert logged_steps(run_dir) == [1, 2, 3, 4]

    forced = run_trainer(short_config, run_dir, "train.max_steps=5", "train.lr_matrix=0.01", "--accept-config-change")
    assert forced.returncode == 0, forced.stderr
    assert resumed_from(run_dir).endswith("step_000004") and logged_steps(run_dir) == [1, 2, 3, 4, 5]
    # the forced config is the run's record from now on
    assert load_config(os.path.join(run_dir, "config.yaml")).train.lr_matrix == 0.01
