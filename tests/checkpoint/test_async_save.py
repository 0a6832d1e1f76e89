"""Issue 68 on 2 real gloo ranks (EP=2): a save in the background (`train.checkpoint_async`) resumes exactly as a
synchronous one, and a publish that fails on rank 0 ends every rank at once with the same line, on either path.

* Resume equality: the same run saved at step 2 in the background and synchronously; each resumed from its step_2
  to step 6 writes the same metrics bitwise (timings aside), and the two step_2 checkpoints hold the same tensors.
* A failed publish (planted: rank 0's save directory moved away just before the publish) stops both ranks with the
  one line naming the moved directory: the synchronous path at that save, the background path at the first sync
  step after the thread ended (or the next save point). Before issue 68, rank 1 waited at the barrier after the publish until the process group's timeout.
"""
import json
import os
import shutil
import time

import pytest

from gloo_ranks import run_on_ranks
from trainer_processes import TIMING_KEYS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ep2_overrides(request, micro_data):
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    return [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}", "train.hang_timeout_s=0",
            "log.every=1", "parallel.ep=2", "train.sync_every=1", "train.keep_checkpoints=5"]


def trainer_for(run_dir, overrides):
    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    return Trainer(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), run_dir, quiet=True)


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f]


# --------------------------------------------------------------------------------------------------------------
def saved_then_resumed(root, overrides):
    """Each rank: per mode, train to step 4 saving every 2 steps, drop step_4 (rank 0), resume from step_2 to 6."""
    import torch.distributed as dist

    out = {}
    for mode in ("off", "on"):
        run_dir = os.path.join(root, mode)
        first = trainer_for(run_dir, [*overrides, f"train.checkpoint_async={mode}", "train.checkpoint_every=2",
                                      "train.max_steps=4"])
        out[mode] = {"background": first.background_save is not None}
        first.run()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(run_dir, "checkpoints", "step_000004"))
        dist.barrier()
        resumed = trainer_for(run_dir, [*overrides, f"train.checkpoint_async={mode}", "train.checkpoint_every=0",
                                        "train.max_steps=6"])
        out[mode]["resumed_at"] = resumed.progress.step
        resumed.run()
    return out


def step2_tensors(run_dir):
    """The whole model of the run's step_2 checkpoint, read in one process (every expert, from both ranks)."""
    from nagmoe.checkpoint import load_model_weights
    from nagmoe.model import build_model
    from nagmoe.rundir.info import read_saved_config

    model = build_model(read_saved_config(run_dir).model)
    load_model_weights(os.path.join(run_dir, "checkpoints", "step_000002"), model)
    return model.state_dict()


def test_resume_from_a_background_save_equals_resume_from_a_synchronous_one(ep2_overrides, tmp_path):
    import torch

    ranks = run_on_ranks(saved_then_resumed, 2, str(tmp_path), ep2_overrides, timeout=600)
    for r in ranks:
        assert r["off"] == {"background": False, "resumed_at": 2} and r["on"] == {"background": True,
                                                                                   "resumed_at": 2}, r
    sync_run, async_run = str(tmp_path / "off"), str(tmp_path / "on")
    assert records(async_run) == records(sync_run)  # steps 1-6, the resumed steps 3-6 included
    assert len(records(sync_run)) == 6
    a, b = step2_tensors(sync_run), step2_tensors(async_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------------------
def moved_publish(run_dir, overrides):
    """Each rank: a run whose step-2 save has its directory moved away by rank 0 just before the publish;
    (the line it stopped with, seconds from the save's start to the stop, the steps it logged)."""
    import torch.distributed as dist

    from nagmoe.base.errors import UserError
    from nagmoe.checkpoint import publish as pub, torch_layout

    trainer = trainer_for(run_dir, overrides)
    real = torch_layout.publish
    started = {}

    def planted(tmp, final, *args, **kwargs):
        os.rename(tmp, tmp.replace(".tmp-", ".moved-"))  # another process takes the directory away
        return real(tmp, final, *args, **kwargs)

    assert pub.publish is real
    if dist.get_rank() == 0:
        torch_layout.publish = planted
    real_checkpoint = trainer.checkpoint

    def checkpoint(*args, **kwargs):
        started.setdefault("t", time.monotonic())
        return real_checkpoint(*args, **kwargs)
    trainer.checkpoint = checkpoint
    try:
        trainer.run()
        line = None
    except UserError as e:
        line = str(e)
    finally:
        torch_layout.publish = real
    return {"line": line, "after_s": time.monotonic() - started["t"], "step": trainer.progress.step}


@pytest.mark.parametrize("mode", ["off", "on"], ids=["synchronous", "background"])
def test_a_publish_failing_on_rank_0_ends_both_ranks_with_its_line(ep2_overrides, tmp_path, mode):
    run_dir = str(tmp_path / "run")
    ranks = run_on_ranks(moved_publish, 2, run_dir, [*ep2_overrides, f"train.checkpoint_async={mode}",
                                                     "train.checkpoint_every=2", "train.max_steps=6"],
                         timeout=240, pg_timeout_s=60)
    lines = {r["line"] for r in ranks}
    assert len(lines) == 1, ranks  # the same line on both ranks
    (line,) = lines
    assert line is not None and "was moved by another process before it was published" in line, line
    assert "step_000002.tmp-" in line
    # at once: the synchronous path at the save itself; the background path at the first sync step (sync_every 1)
    # after rank 0's thread ended, or at the next save point (step 4), which settles the save in flight first
    steps = [r["step"] for r in ranks]
    assert steps[0] == steps[1] and (steps[0] == 2 if mode == "off" else 2 < steps[0] <= 4), ranks
    assert all(r["after_s"] < 30 for r in ranks), ranks  # not the process group's 60 s timeout
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_000002"))


def test_the_deepspeed_engine_refuses_background_saves_with_one_line(micro_data, tmp_path, request):
    from nagmoe.base.errors import UserError

    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    with pytest.raises(UserError, match="train.checkpoint_async: on is not supported by parallel.engine=deepspeed"):
        trainer_for(str(tmp_path / "run"), [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}",
                                            "parallel.engine=deepspeed", "train.checkpoint_async=on"])
