"""Resume on another world size (issue 25, item 4): a checkpoint saved on one (world size, parallel.ep,
train.micro_batch_tokens) layout resumes through the Trainer on another.

The reference is 6 steps straight in one process. The same run is then trained as
  * 2 steps on 4 gloo ranks (EP=2 x DP=2, micro-batches of 1 row: no accumulation),
  * 2 steps on 2 ranks (EP=2, micro-batches of 2 rows), resuming the 4-rank run dir,
  * 2 steps in 1 process (micro-batches of 1 row: 4 accumulation micro-steps), resuming the 2-rank run dir,
without --accept-config-change (parallel.ep and train.micro_batch_tokens may change on resume). The per-step losses continue
the reference within the distributed tolerance of tests/parallel/test_parallel_training.py (1e-5, at its
lr_embed 0.02), every step reads the reference's rows, the saved loader states equal the reference's and the
saved RNG states the restored ones (exactly), the final weights (expert stacks re-sliced by global expert index
at each load, their Muon/AdamW state with them; 1e-5, with AdamW's eps raised in reference and chain alike: the
bound of test_parallel_training.py's TOL) and progress (step, tokens, FLOPs) equal the reference's. Changing
train.batch_tokens (the global batch) on resume is refused by `nagmoe train` with one line, exit 2; so is a
layout change on the DeepSpeed engine. A rank the saving layout did not have gets generators seeded from
(seed, step, rank). The expert bias is on: its b and the flip statistic's signs follow the reference through
every layout (issue 43).
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gloo_ranks import run_on_ranks
from test_parallel_training import BASE, TOL, load, make_trainer, params_of, step_losses

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 6
PHASES = (  # (world size, parallel.ep, train.micro_batch_tokens, stop after this many steps)
    (4, 2, 64, 2),
    (2, 2, 128, 4),
    (1, 1, 64, 6),
)
# train.batch_tokens=256 (tests/conftest.py): 4 rows of 64 tokens per optimizer step; checkpoints every 2 steps.
# No load-balancing loss: it is a statistic of each (rank, micro-batch) (nagmoe/model/moe.py), so another
# micro-batch size changes the objective itself (the run after such a resume is a slightly different run:
# 2e-4 in the loss one step after 1-row instead of 2-row micro-batches, on this model); without it the
# step's gradient is the same for every split of the global batch, and the chain must follow the reference.
# The loss-free expert bias is on (issue 43): b is a replicated buffer, saved and resharded with the model, and
# the last update's signs (the flip statistic) ride in the checkpoint's extra state.
COMMON = (f"train.max_steps={STEPS}", "train.checkpoint_every=2", "train.keep_checkpoints=3",
          "model.moe.lb_loss_weight=0", "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")


def layout_overrides(ep, micro):
    return [f"parallel.ep={ep}", f"train.micro_batch_tokens={micro}"]


def train_phase(overrides, run_dir, max_steps):
    """One phase of the chain on this rank: resume `run_dir` (if it has a checkpoint), train to `max_steps`."""
    import torch.distributed as dist

    trainer = make_trainer([*overrides, f"train.max_steps={max_steps}"], run_dir)  # AdamW eps: TOL's comment
    start = trainer.progress.step
    trainer.run()
    rank = dist.get_rank() if dist.is_initialized() else 0
    from nagmoe.model.router_health import expert_biases

    return {"start": start, "rows": trainer.loader.rows, "params": params_of(trainer.model),
            "bias": expert_biases(trainer.model).tolist(),
            "expert_names": trainer.expert_names, "ep_rank": trainer.mesh.ep_rank, "accum": trainer.accum,
            "progress": trainer.progress.as_dict(), "losses": step_losses(run_dir) if rank == 0 else None}


def saved_state(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "state.json")) as f:
        return json.load(f)


def rows_by_step(result, first_step, n_steps):
    """{step: sorted row bytes} of one rank's recorded micro-batches (`accum` micro-batches per step)."""
    out, rows = {}, result["rows"]
    assert len(rows) == n_steps * result["accum"]
    for i in range(n_steps):
        batch = rows[i * result["accum"]:(i + 1) * result["accum"]]
        out[first_step + 1 + i] = [r.tobytes() for b in batch for r in b]
    return out


def full_params(results):
    """The full model's parameters from the ranks of one phase (expert stacks concatenated by EP rank)."""
    full = dict(results[0]["params"])
    experts = set(results[0]["expert_names"])
    ep_ranks = {}
    for r in results:
        ep_ranks.setdefault(r["ep_rank"], r)  # one replica of each EP rank's slice
    for n in experts:
        full[n] = np.concatenate([ep_ranks[p]["params"][n] for p in sorted(ep_ranks)])
    return full


@pytest.fixture(scope="module")
def overrides(micro_overrides):
    return [*micro_overrides, *BASE, *COMMON]


@pytest.fixture(scope="module")
def reference(overrides, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    trainer = make_trainer([*overrides, *layout_overrides(1, 128)], run_dir)
    trainer.run()
    from nagmoe.model.router_health import expert_biases

    rec = {"start": 0, "rows": trainer.loader.rows, "accum": trainer.accum, "params": params_of(trainer.model),
           "bias": expert_biases(trainer.model).tolist(),
           "expert_names": [], "ep_rank": 0, "progress": trainer.progress.as_dict(), "losses": step_losses(run_dir)}
    return run_dir, rec


@pytest.fixture(scope="module")
def chain(overrides, tmp_path_factory):
    """The run trained as 4 -> 2 -> 1 ranks; returns (run dir, [per phase: results by rank])."""
    run_dir = str(tmp_path_factory.mktemp("chain") / "run")
    phases = []
    for world, ep, micro, stop in PHASES:
        args = ([*overrides, *layout_overrides(ep, micro)], run_dir, stop)
        if world == 1:
            phases.append([train_phase(*args)])
        else:
            phases.append(run_on_ranks(train_phase, world, *args, timeout=240))
    return run_dir, phases


@pytest.mark.distributed
def test_resume_on_4_then_2_then_1_ranks_continues_the_reference(chain, reference):
    run_dir, phases = chain
    ref_dir, ref = reference
    assert [p[0]["start"] for p in phases] == [0, 2, 4]
    assert [len(p) for p in phases] == [4, 2, 1] and [p[0]["accum"] for p in phases] == [1, 1, 4]
    assert phases[0][0]["expert_names"] and phases[0][0]["params"]["blocks.0.ffn.w_in"].shape[0] == 2

    # losses: each step once (metrics of every phase in the run dir), on the reference's trajectory
    got = phases[-1][0]["losses"]
    assert [s for s, _ in got] == [s for s, _ in ref["losses"]] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, v in got], [v for _, v in ref["losses"]], rtol=0, atol=TOL)

    # data: every step of every phase reads exactly the reference's rows (over its ranks together)
    want = rows_by_step(ref, 0, STEPS)
    for results, (world, _, _, stop) in zip(phases, PHASES):
        start = results[0]["start"]
        mine = {}
        for r in results:
            for step, rows in rows_by_step(r, start, stop - start).items():
                mine.setdefault(step, []).extend(rows)
        for step, rows in mine.items():
            assert sorted(rows) == sorted(want[step]), f"step {step} on {world} ranks read other rows"

    # the loader states and progress saved at each phase's end equal the reference's at that step
    for step in (2, 4, 6):
        saved, ref_saved = saved_state(run_dir, step), saved_state(ref_dir, step)
        assert saved["extra"]["loader"] == ref_saved["extra"]["loader"], step
        progress, ref_progress = saved["extra"]["progress"], ref_saved["extra"]["progress"]
        assert (progress["step"], progress["tokens"]) == (ref_progress["step"], ref_progress["tokens"]) == (
            step, step * 256)
        assert progress["flops"] == pytest.approx(ref_progress["flops"], rel=1e-12)
        # the expert bias's last update signs (b itself is checked below, in the final model)
        assert saved["extra"]["expert_bias_signs"] == ref_saved["extra"]["expert_bias_signs"], step
    # RNG: rank r restores what rank r saved and nothing in training draws from the generators
    # (nagmoe/checkpoint/rng.py), so each phase saves exactly the states it restored, every generator
    rng = {s: saved_state(run_dir, s)["rng"] for s in (2, 4, 6)}
    assert [len(rng[s]) for s in (2, 4, 6)] == [4, 2, 1]
    for step, before in ((4, 2), (6, 4)):
        for rank, state in enumerate(rng[step]):
            same = {g: v == rng[before][rank][g] for g, v in state.items()}
            assert all(same.values()), f"rank {rank}'s RNG state at step {step} is not the one of step {before}: {same}"
    # torch's CPU generator is seeded with train.seed on every rank at start (Trainer), so every saved state is
    # the reference's; numpy's and python's are each process's own (unseeded), only their restore is checked
    ref_torch = {saved_state(ref_dir, s)["rng"][0]["torch_cpu"] for s in (2, 4, 6)}
    assert len(ref_torch) == 1 and {r["torch_cpu"] for s in (2, 4, 6) for r in rng[s]} == ref_torch
    assert [saved_state(run_dir, s)["layout"] for s in (2, 4, 6)] == [
        {"world_size": 4, "ep": 2}, {"world_size": 2, "ep": 2}, {"world_size": 1, "ep": 1}]

    # weights: the 4- and 2-rank phases' replicas agree; the final model is the reference's
    for results in phases[:2]:
        experts = set(results[0]["expert_names"])
        for r in results[1:]:
            for n, v in r["params"].items():
                if n not in experts or r["ep_rank"] == results[0]["ep_rank"]:
                    np.testing.assert_array_equal(v, results[0]["params"][n], err_msg=n)
    # b: bitwise on every rank of a phase, and the final b is the reference's (integer counts, the same choices)
    for results in phases:
        assert all(r["bias"] == results[0]["bias"] for r in results)
    assert phases[-1][0]["bias"] == ref["bias"] and max(abs(v) for row in ref["bias"] for v in row) > 0
    # Reference and chain run AdamW at eps 1e-3 (make_trainer): the other layouts' summation-order rounding then
    # moves no element by more than ~1e-6 on any CPU (TOL's bound in test_parallel_training.py; measured 2.4e-7),
    # where eps 1e-10 amplified it to 1.4e-5 on an AVX2 CPU. A resume that loses state moves many elements by
    # O(lr): AdamW's exp_avg_sq or Muon's momentum zeroed on load moved 30% / 43% of wte.weight, by up to 3e-3 /
    # 7e-3 (and the losses of steps 4-6 by 1e-3 / 8e-3).
    final = full_params(phases[-1])
    assert set(final) == set(ref["params"])
    for n, v in ref["params"].items():
        np.testing.assert_allclose(final[n], v, rtol=0, atol=TOL, err_msg=n)


def nagmoe_train(run_dir, overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                            "SLURM_NTASKS")}
    return subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", "configs/tiny.yaml", "--run-dir",
                           run_dir, "--quiet", *overrides], cwd=REPO, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)


def tree(run_dir):
    out = {}
    for d, _, files in os.walk(run_dir):
        for name in files:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), run_dir)] = f.read()
    return out


@pytest.mark.distributed
def test_changing_the_global_batch_on_resume_is_refused_with_one_line(reference, overrides, tmp_path):
    ref_dir, _ = reference
    run_dir = str(tmp_path / "run")
    shutil.copytree(ref_dir, run_dir)
    before = tree(run_dir)
    r = nagmoe_train(run_dir, [*overrides, *layout_overrides(1, 128), "train.max_steps=7", "train.batch_tokens=512"])
    message = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in message and "Traceback" not in message, r.stderr
    assert message.startswith("nagmoe train: error: ") and "train.batch_tokens: 256 -> 512" in message
    assert "parallel.ep" in message and "train.micro_batch_tokens" in message  # what may change
    assert tree(run_dir) == before  # refused before anything was written


def test_a_layout_change_on_the_deepspeed_engine_is_refused_with_one_line(tmp_path, micro_overrides):
    """The DeepSpeed engine resumes on the layout it saved on only: refused before anything is built."""
    from nagmoe.checkpoint.resume import check_resume_layout
    from nagmoe.rundir.info import prepare_run_dir
    from nagmoe.base.errors import UserError

    saved = load([*micro_overrides, "parallel.engine=deepspeed", "train.optimizer=adamw", "parallel.ep=2",
                  "train.micro_batch_tokens=64"])
    prepare_run_dir(str(tmp_path), saved, resuming=False)
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    layout = {"world_size": 2, "ep": 2, "zero_stage": 1}
    (checkpoint / "state.json").write_text(json.dumps({"format": "deepspeed-1", "step": 2, "rng": [{}, {}],
                                                       "extra": {}, "layout": layout}))
    assert check_resume_layout(str(checkpoint), str(tmp_path), saved, 2) is None  # the same layout
    for world, changed, what in ((1, [], "world size 2 -> 1"), (2, ["parallel.ep=1"], "parallel.ep 2 -> 1"),
                                 (2, ["train.micro_batch_tokens=128"], "train.micro_batch_tokens 64 -> 128")):
        new = load([*micro_overrides, "parallel.engine=deepspeed", "train.optimizer=adamw", "parallel.ep=2",
                    "train.micro_batch_tokens=64", *changed])
        with pytest.raises(UserError, match="parallel.engine=deepspeed") as e:
            check_resume_layout(str(checkpoint), str(tmp_path), new, world)
        assert what in str(e.value) and "\n" not in str(e.value)
    # the torch engine reshards: the same change is a description for the log, not an error
    torch_saved = load([*micro_overrides, "parallel.ep=2", "train.micro_batch_tokens=64"])
    prepare_run_dir(str(tmp_path), torch_saved, resuming=False)
    (checkpoint / "state.json").write_text(json.dumps({"format": 1, "step": 2, "rng": [{}, {}], "extra": {},
                                                       "layout": {"world_size": 2, "ep": 2}}))
    assert check_resume_layout(str(checkpoint), str(tmp_path), load([*micro_overrides, "parallel.ep=1"]), 1) == (
        "world size 2 -> 1, parallel.ep 2 -> 1, train.micro_batch_tokens 64 -> None")


def test_a_rank_the_saving_layout_did_not_have_gets_generators_from_seed_step_and_rank():
    import random

    import torch

    from nagmoe.checkpoint.rng import capture_rng_state, restore_rank_rng

    def draws():
        return torch.rand(3).tolist(), float(np.random.rand()), random.random()

    states = []
    for r in range(2):  # what 2 ranks saved
        torch.manual_seed(100 + r)
        np.random.seed(100 + r)
        random.seed(100 + r)
        states.append(capture_rng_state())
    saved_next = []
    for state in states:
        restore_rank_rng(states, states.index(state), seed=1, step=4)
        saved_next.append(draws())
    assert saved_next[0] != saved_next[1]
    assert restore_rank_rng(states, 1, seed=1, step=4) == "restored" and draws() == saved_next[1]  # its own
    derived = {}
    for rank in (2, 3):
        assert restore_rank_rng(states, rank, seed=1, step=4) == "derived"
        derived[rank] = draws()
        restore_rank_rng(states, rank, seed=1, step=4)
        assert draws() == derived[rank]  # deterministic
    assert len({repr(v) for v in [*saved_next, *derived.values()]}) == 4  # no two ranks share a stream
    restore_rank_rng(states, 2, seed=1, step=6)
    assert draws() != derived[2]  # another resume step, another stream
