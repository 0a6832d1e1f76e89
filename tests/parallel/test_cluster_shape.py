"""Issue 25, rehearsal (c): a tiny model at the cluster's shape — 8 real gloo ranks as EP=8 and as EP=4 x DP=2 —
trains the same losses as one process (fp32, the distributed tolerance of test_parallel_training.py), so the
first 32-rank job is not the first time a world larger than 2 meets the expert-parallel and DDP code."""
import os

import numpy as np
import pytest

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.distributed

TOL = 1e-5  # as tests/parallel/test_parallel_training.py (fp32 summation order, lr_embed 0.02)
STEPS = 3
# global batch 8 rows of 64 tokens: one row per rank per step on 8 ranks, 8 accumulated micro-batches in one
BASE = ("model.moe.n_experts=8", "model.nag.C=8", "train.batch_tokens=512", "train.micro_batch_tokens=64",
        f"train.max_steps={STEPS}", "train.eval_tokens=256", "train.schedule_steps=10", "train.lr_embed=0.02")


def _losses(overrides, run_dir):
    from nagmoe.config import load_config
    from nagmoe.train.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    Trainer(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), run_dir, quiet=True).run()
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


def _eight_ranks(overrides, tmp):
    import torch.distributed as dist

    out = {}
    for name, ep in (("ep8", 8), ("ep4_dp2", 4)):
        run_dir = os.path.join(tmp, name)
        losses = _losses([*overrides, f"parallel.ep={ep}"], run_dir)
        out[name] = losses if dist.get_rank() == 0 else None
    return out


@pytest.mark.slow
def test_eight_ranks_as_ep8_and_ep4_dp2_train_the_single_process_losses(micro_overrides, tmp_path):
    overrides = [*micro_overrides, *BASE]
    want = _losses(overrides, str(tmp_path / "single"))
    results = run_on_ranks(_eight_ranks, 8, overrides, str(tmp_path), timeout=600)
    for name in ("ep8", "ep4_dp2"):
        got = results[0][name]
        assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, STEPS + 1)), name
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=0, atol=TOL, err_msg=name)
