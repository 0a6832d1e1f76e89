"""Issue 67, item 1 on 2 real gloo ranks: the loop's decisions every train.sync_every steps keep every guarantee.

* The cadence changes no number: a MoD run to a FLOP budget with sync_every 1 (one exchange a step, the legacy
  value) and 3 writes the same metrics bitwise (up to timings), stops at the same step on both ranks, the step
  the budget rule gives from the logged FLOPs (no collective decides it: nagmoe/train/step_decisions.py).
* A preemption, by a real SIGUSR1 to rank 1 or by the request file, is answered at the first sync step at or
  after it (within sync_every steps) on both ranks, with every line and the checkpoint up to that step.
* A non-finite loss on one rank only (its gradients finite) is skipped by both ranks (the poisoned gradient).
* A lease taken over mid-run stops both ranks at the next sync step with the same line; nothing written after.
"""
import json
import os

import pytest

from gloo_ranks import run_on_ranks
from trainer_processes import TIMING_KEYS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def micro_overrides(request, micro_data):
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    return [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}", "train.hang_timeout_s=0",
            "log.every=1"]


def trainer_for(run_dir, overrides):
    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    return Trainer(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), run_dir, quiet=True)


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def after_step(trainer, at_step, action):
    """Run `action()` on this rank right after optimizer step `at_step` (before the loop's decisions)."""
    real = trainer.train_step

    def step(*args, **kwargs):
        rec = real(*args, **kwargs)
        if trainer.progress.step == at_step:
            action()
        return rec
    trainer.train_step = step


# --------------------------------------------------------------------------------------------------------------
def budget_runs(root, overrides):
    """Each rank: the same MoD run to a FLOP budget at sync_every 1 and 3; the steps each rank stopped at."""
    import torch.distributed as dist

    from nagmoe.config.flops import flops_per_token

    out = {}
    for every in (1, 3):
        run_dir = os.path.join(root, f"sync{every}")
        trainer = trainer_for(run_dir, [*overrides, f"train.sync_every={every}"])
        full_step = flops_per_token(trainer.cfg.model, trainer.cfg.data.seq_len, None,
                                    trainer.cfg.train.flop_convention) * trainer.cfg.train.batch_tokens
        if every == 1:
            out["full_step"] = full_step
        summary = trainer.run()
        out[every] = {"steps": summary["steps"], "flops": summary["flops"], "rank": dist.get_rank()}
    return out


def test_the_sync_cadence_changes_no_number_and_the_budget_stop_is_the_rule(micro_overrides, tmp_path):
    from nagmoe.config import load_config
    from nagmoe.config.flops import flops_per_token

    base = [*micro_overrides, "model.mod.skip_rate=0.5", "model.mod.start_tokens=0", "train.max_steps=null"]
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), base)
    full_step = flops_per_token(cfg.model, cfg.data.seq_len, None, cfg.train.flop_convention) * cfg.train.batch_tokens
    budget = 7.3 * full_step  # MoD steps cost less: the stop comes after more than 7 steps
    ranks = run_on_ranks(budget_runs, 2, str(tmp_path), [*base, f"train.flop_budget={budget!r}"], timeout=600)
    for every in (1, 3):
        assert ranks[0][every]["steps"] == ranks[1][every]["steps"] > 7  # the same stop on both ranks, no collective
        assert ranks[0][every]["flops"] == ranks[1][every]["flops"]
    a, b = records(str(tmp_path / "sync1")), records(str(tmp_path / "sync3"))
    drop = (*TIMING_KEYS,)
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b]
    # the stop rule on the logged FLOPs: after step k the run stops iff flops_k + step_k / 2 > budget, where
    # step_k (the last step's price) = flops_k - flops_{k-1}; MoD made the steps cheaper than full depth
    flops = [0.0] + [r["flops"] for r in a]
    prices = [flops[k] - flops[k - 1] for k in range(1, len(flops))]
    assert min(prices) < 0.95 * full_step
    decisions = [flops[k] + 0.5 * prices[k - 1] > budget for k in range(1, len(flops))]
    assert decisions == [False] * (len(decisions) - 1) + [True]
    assert len(a) == ranks[0][1]["steps"]


# --------------------------------------------------------------------------------------------------------------
def preempted_run(run_dir, overrides, how, at_step):
    import signal

    import torch.distributed as dist

    from nagmoe.train.preemption import Preempted, request_stop

    trainer = trainer_for(run_dir, overrides)
    if dist.get_rank() == 1:  # rank 1 only: rank 0 must stop with it
        action = ((lambda: os.kill(os.getpid(), signal.SIGUSR1)) if how == "signal"
                  else (lambda: request_stop(run_dir)))
        after_step(trainer, at_step, action)
    try:
        trainer.run()
    except Preempted as e:
        return {"stopped": e.step, "checkpoint": e.checkpoint}
    return {"stopped": None}


@pytest.mark.parametrize("how,at_step,stopped", [("signal", 5, 8), ("request", 5, 8), ("signal", 4, 4)])
def test_a_preemption_is_answered_at_the_next_sync_step_on_both_ranks(micro_overrides, tmp_path, how, at_step,
                                                                      stopped):
    run_dir = str(tmp_path / "run")
    ranks = run_on_ranks(preempted_run, 2, run_dir, [*micro_overrides, "train.sync_every=4", "train.max_steps=12",
                                                     "train.schedule_steps=12"], how, at_step, timeout=300)
    assert [r["stopped"] for r in ranks] == [stopped, stopped]
    assert ranks[0]["checkpoint"].endswith(f"step_{stopped:06d}")
    assert [r["step"] for r in records(run_dir)] == list(range(1, stopped + 1))  # every line up to the stop
    marker = json.load(open(os.path.join(run_dir, "preempted.json")))
    assert marker["step"] == stopped and marker["reason"] == ("another rank" if how == "signal"
                                                              else "preempt.request")
    assert not os.path.exists(os.path.join(run_dir, "preempt.request"))  # consumed


# --------------------------------------------------------------------------------------------------------------
def nan_loss_on_rank1(run_dir, overrides, at_step):
    """Rank 1's loss value is NaN at `at_step` but its gradients are finite (a NaN constant added, no grad)."""
    import torch
    import torch.distributed as dist

    trainer = trainer_for(run_dir, overrides)
    if dist.get_rank() == 1:
        real = trainer.model.forward

        def forward(*args, **kwargs):
            out = real(*args, **kwargs)
            if trainer.progress.step == at_step - 1 and torch.is_grad_enabled():
                out = out._replace(loss=out.loss + torch.tensor(float("nan")))
            return out
        trainer.model.forward = forward
    summary = trainer.run()
    weights = sum(float(p.detach().double().sum()) for p in trainer.replicated_params)
    return {"skipped": trainer.progress.nonfinite_skipped, "steps": summary["steps"], "weights": weights}


def test_a_nonfinite_loss_on_one_rank_is_skipped_by_both(micro_overrides, tmp_path):
    ranks = run_on_ranks(nan_loss_on_rank1, 2, str(tmp_path / "run"),
                         [*micro_overrides, "train.nonfinite=skip", "train.max_steps=5"], 3, timeout=300)
    assert [r["skipped"] for r in ranks] == [1, 1]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas took the same steps


# --------------------------------------------------------------------------------------------------------------
def taken_over_run(run_dir, overrides, at_step):
    import torch.distributed as dist

    from nagmoe.base.errors import UserError
    from nagmoe.rundir.lease import RunDirLease

    trainer = trainer_for(run_dir, overrides)
    if dist.get_rank() == 0:  # another trainer takes the run dir (a stranger's lease) after step `at_step`
        after_step(trainer, at_step, lambda: RunDirLease(run_dir, take_over=True).acquire()._stop.set())
    try:
        trainer.run()
    except UserError as e:
        return {"error": str(e), "step": trainer.progress.step}
    return {"error": None}


@pytest.mark.parametrize("checkpoint_every,stopped", [(0, 8), (6, 6)])
def test_a_lost_lease_stops_both_ranks_before_any_write(micro_overrides, tmp_path, checkpoint_every, stopped):
    """Taken over after step 5: the next sync step (8) stops both ranks, or the fence before step 6's save."""
    run_dir = str(tmp_path / "run")
    ranks = run_on_ranks(taken_over_run, 2, run_dir, [*micro_overrides, "train.sync_every=4", "train.max_steps=12",
                                                      f"train.checkpoint_every={checkpoint_every}"], 5, timeout=300)
    assert ranks[0]["error"] == ranks[1]["error"] and "taken over by" in ranks[0]["error"], ranks
    assert [r["step"] for r in ranks] == [stopped, stopped]
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # 5 on were buffered: never written
    checkpoints = os.path.join(run_dir, "checkpoints")
    assert not os.path.isdir(checkpoints) or not [n for n in os.listdir(checkpoints) if n.startswith("step_")]
    assert not os.path.exists(os.path.join(run_dir, "summary.json"))
