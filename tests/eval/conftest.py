"""The shared micro run: a tiny prepared dataset and ~10 training steps of a micro config (session-scoped).

Self-contained and parameterless so that it can move to tests/conftest.py as the suite's shared micro run.
"""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO_OVERRIDES = [
    "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.max_seq_len=128",
    "model.moe.expert_hidden=128", "model.nag.warmup_tokens=0",
    "data.seq_len=64", "train.batch_tokens=512", "train.max_steps=10", "train.schedule_steps=10",
    "train.warmup_steps=2", "train.eval_every=0", "train.checkpoint_every=0", "train.eval_tokens=2048",
    "train.device=cpu", "log.wandb=off",
]


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory):
    """Path of a finished micro run dir (config.yaml, metrics.jsonl, checkpoints/, summary.json): configs/tiny.yaml
    (NAG, CCA, MoE) shrunk to d_model 64, 2 layers, seq 64, 512-token batches, 10 steps, on a 512-token BPE of
    the offline Shakespeare corpus."""
    from nagmoe.config import load_config
    from nagmoe.data.prepare import prepare_single
    from nagmoe.train.trainer import Trainer

    root = tmp_path_factory.mktemp("micro_run")
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"),
                      [f"data.data_dir={root / 'data'}", *MICRO_OVERRIDES])
    prepare_single(cfg)
    run_dir = str(root / "run")
    Trainer(cfg, run_dir, quiet=True).run()
    return run_dir
