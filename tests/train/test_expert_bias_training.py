"""The expert bias in the trainer (issue 43 item 1): one update per taken optimizer step from the step's counts
over the whole global batch; none on a skipped step, in eval or guard re-runs; saved, resumed, exported; its
telemetry; no new host read."""
import tempfile

import pytest
import torch

from nagmoe.model.router_health import expert_biases, moe_layers

BIAS = ("model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")


def trainer_for(micro_config, *overrides, run_dir=None):
    from nagmoe.train.trainer import Trainer

    return Trainer(micro_config(*BIAS, *overrides), run_dir or tempfile.mkdtemp(), quiet=True)


def test_one_update_per_step_whatever_the_accumulation(micro_config):
    """accum 1 vs 4 over the same global batch: the same counts, the same b after step 1 (bitwise)."""
    one = trainer_for(micro_config, "train.micro_batch_tokens=256")
    four = trainer_for(micro_config, "train.micro_batch_tokens=64")
    assert (one.accum, four.accum) == (1, 4)
    one.train_step()
    four.train_step()
    assert torch.equal(one.routing.counts_LE, four.routing.counts_LE)
    b1, b4 = expert_biases(one.model), expert_biases(four.model)
    assert torch.equal(b1, b4) and float(b1.abs().max()) > 0  # moved, and once: |b_e| <= rate·(1 + 1)
    assert float(b1.abs().max()) <= 0.02 + 1e-7


def test_counts_under_activation_checkpointing_are_counted_once(micro_config):
    plain = trainer_for(micro_config, "model.mod.skip_rate=0")
    ckpt = trainer_for(micro_config, "model.mod.skip_rate=0", "train.activation_checkpointing=true")
    plain.train_step()
    ckpt.train_step()
    top_k, tokens = plain.cfg.model.moe.top_k, plain.cfg.train.batch_tokens
    assert torch.equal(plain.routing.counts_LE, ckpt.routing.counts_LE)
    assert plain.routing.counts_LE.sum(1).tolist() == [top_k * tokens] * len(moe_layers(plain.model))
    assert torch.equal(expert_biases(plain.model), expert_biases(ckpt.model))


def test_eval_and_guard_forwards_do_not_move_the_bias(micro_config):
    t = trainer_for(micro_config, "train.gate_collapse_every=1")
    t.train_step()
    before = expert_biases(t.model).clone()
    t.evaluate()
    from nagmoe.train.guards import realised_gains

    realised_gains(t.model, t._last_batch[0], t.autocast)
    with torch.no_grad():
        t.model(t._last_batch[0])
    assert torch.equal(before, expert_biases(t.model))


def test_a_skipped_nonfinite_step_leaves_the_bias(micro_config):
    t = trainer_for(micro_config, "train.nonfinite=skip")
    t.train_step()
    before = expert_biases(t.model).clone()
    sub = list(t.model.sublayers())[1]
    handle = sub.register_forward_hook(lambda m, i, out: (out[0] * float("nan"), *out[1:]))
    rec = t.train_step()
    handle.remove()
    assert rec["nonfinite_skipped"] == 1
    assert torch.equal(before, expert_biases(t.model))
    t.train_step()
    assert not torch.equal(before, expert_biases(t.model))  # the next taken step moves it again


def router_records(run_dir):
    import os

    from nagmoe.rundir.metrics import read_metrics

    return {r["step"]: r["router"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "router" in r}


def test_save_and_resume_equal_the_straight_run(micro_config, tmp_path):
    """b and the flip statistic's previous signs (checkpoint extra state) continue the straight run: the
    metrics' router telemetry after the resume, flip share included, is the straight run's."""
    log = ("log.every=1",)
    straight = trainer_for(micro_config, "train.max_steps=4", *log, run_dir=str(tmp_path / "a"))
    straight.run()
    first = trainer_for(micro_config, "train.max_steps=2", *log, run_dir=str(tmp_path / "b"))
    first.run()
    resumed = trainer_for(micro_config, "train.max_steps=4", *log, run_dir=str(tmp_path / "b"))
    assert torch.equal(expert_biases(resumed.model), expert_biases(first.model))  # loaded, not zeros
    assert torch.equal(resumed.routing.bias_signs, first.routing.bias_signs)
    resumed.run()
    assert torch.equal(expert_biases(straight.model), expert_biases(resumed.model))
    want, got = router_records(str(tmp_path / "a")), router_records(str(tmp_path / "b"))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert "bias_flip_share" not in want[1] and "bias_flip_share" in want[3]  # step 1 has no previous update
    for step in (3, 4):  # the first steps after the resume
        assert got[step] == want[step], step


def test_the_flip_share_equals_a_hand_count_of_the_update_signs(micro_config):
    t = trainer_for(micro_config)
    signs = []
    for _ in range(5):
        t.train_step()
        c = t.routing.counts_LE.double()
        signs.append(torch.sign(c.mean(1, keepdim=True) - c))
    flips = sum((a != b).double().sum(1) for a, b in zip(signs, signs[1:]))
    report = t.routing.report(t.mesh.ep, t.model)
    E = t.cfg.model.moe.n_experts
    assert report["bias_flip_share"] == pytest.approx((flips / (4 * E)).tolist(), abs=1e-12)
    assert 0 < max(report["bias_flip_share"]) < 1  # some signs flipped, not all (the check can fail)
    for _ in range(2):  # a new interval: the flips since the last report only
        t.train_step()
        c = t.routing.counts_LE.double()
        signs.append(torch.sign(c.mean(1, keepdim=True) - c))
    flips = sum((a != b).double().sum(1) for a, b in zip(signs[4:], signs[5:]))
    report = t.routing.report(t.mesh.ep, t.model)
    assert report["bias_flip_share"] == pytest.approx((flips / (2 * E)).tolist(), abs=1e-12)
    frozen = trainer_for(micro_config, "model.moe.bias_update_rate=0")
    frozen.train_step()
    frozen.train_step()
    assert "bias_flip_share" not in frozen.routing.report(frozen.mesh.ep, frozen.model)
    assert frozen.routing.bias_signs is None


def test_malformed_saved_signs_are_one_line(micro_config):
    from nagmoe.base.errors import UserError
    from nagmoe.model.router_health import saved_bias_signs

    t = trainer_for(micro_config)
    L, E = expert_biases(t.model).shape
    good = [[1] * E] * L
    assert saved_bias_signs({"expert_bias_signs": good}, t.model, "ckpt").tolist() == good
    assert saved_bias_signs({}, t.model, "ckpt") is None
    for bad in ([[1] * E] * (L + 1), [[2] * E] * L, [[True] * E] * L, "x" * 10 ** 5, [[1.0] * E] * L):
        with pytest.raises(UserError) as e:
            saved_bias_signs({"expert_bias_signs": bad}, t.model, "ckpt/state.json")
        assert "\n" not in str(e.value) and len(str(e.value)) < 400 and "expert_bias_signs" in str(e.value)


def test_a_bias_on_resume_from_a_checkpoint_without_it_is_one_line(micro_config, tmp_path, capsys):
    from nagmoe.base.errors import UserError
    from nagmoe.train.trainer import Trainer

    run_dir = str(tmp_path / "run")
    Trainer(micro_config("train.max_steps=2"), run_dir, quiet=True).run()
    with pytest.raises(UserError) as e:
        Trainer(micro_config(*BIAS, "train.max_steps=4"), run_dir, quiet=True, accept_config_change=True)
    message = str(e.value)
    assert "\n" not in message and "expert_bias" in message and len(message) < 400


def test_the_report_reads_the_bias_and_rerouting(micro_config):
    frozen = trainer_for(micro_config, "model.moe.bias_update_rate=0")
    frozen.train_step()
    report = frozen.routing.report(frozen.mesh.ep, frozen.model)
    assert report["rerouted_frac"] == [0.0] * len(moe_layers(frozen.model)) and report["bias_range"] == [0.0, 0.0]
    moving = trainer_for(micro_config)
    for _ in range(3):
        moving.train_step()
    report = moving.routing.report(moving.mesh.ep, moving.model)
    b = expert_biases(moving.model).double()
    assert report["bias_range"] == pytest.approx((b.max(1).values - b.min(1).values).tolist(), abs=1e-12)
    assert report["bias_std"] == pytest.approx(b.std(1, unbiased=False).tolist(), abs=1e-12)
    assert max(report["rerouted_frac"]) > 0


def test_no_new_host_read_per_step(micro_config):
    from nagmoe.train.sync_count import SyncCounter

    t = trainer_for(micro_config, "model.mod.skip_rate=0", "train.micro_batch_tokens=128")
    t.train_step()
    with SyncCounter() as counter:
        t.train_step()
    assert counter.by_file() == {"nagmoe/train/trainer.py": 1}, counter.table()


@pytest.mark.parametrize("clip", [1e-3, 1.0, 0.0])
def test_the_step_record_has_the_clip_coefficient(micro_config, clip):
    """Issue 43 item 3: the factor global clipping scaled the gradients by, from the norm already read."""
    t = trainer_for(micro_config, f"train.grad_clip={clip}")
    rec = t.train_step()
    if clip == 0:
        assert rec["clip_coef"] is None
    else:
        assert rec["clip_coef"] == pytest.approx(min(1.0, clip / (rec["grad_norm"] + 1e-6)))
        assert (rec["clip_coef"] < 1.0) == (rec["grad_norm"] > clip)
