"""Issue 27, checkpoints on a clock: `train.checkpoint_every_minutes` is decided on rank 0's clock and
followed by every rank. On 2 gloo ranks whose clocks disagree (rank 0: 45 s per step, so a save every 2
steps at 1 minute; rank 1: 1000 s per step, which alone would save every step), the run saves at rank 0's
steps and no rank waits in a save the other did not start."""
import os

import pytest

from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.distributed

SECONDS_PER_STEP = {0: 45.0, 1: 1000.0}


def train_with_skewed_clock(overrides, run_dir):
    import torch.distributed as dist

    from nagmoe.checkpoint.files import list_checkpoints
    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = Trainer(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), run_dir, quiet=True)
    pace = SECONDS_PER_STEP[dist.get_rank()]
    trainer.clock = lambda: pace * trainer.progress.step  # each rank its own clock
    trainer.run()
    dist.barrier()
    return [s for s, _ in list_checkpoints(run_dir)]


def test_time_based_saves_follow_rank_zeros_clock(micro_overrides, tmp_path):
    overrides = [*micro_overrides, "train.max_steps=7", "train.checkpoint_every_minutes=1", "train.sync_every=1",
                 "train.keep_checkpoints=10", "train.micro_batch_tokens=64"]
    results = run_on_ranks(train_with_skewed_clock, 2, overrides, str(tmp_path / "run"), timeout=240)
    assert results[0] == results[1] == [2, 4, 6, 7]
