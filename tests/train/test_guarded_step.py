"""The step's metrics read after the optimizer step (issue 60, item 3): the non-finite guard decided on the
device (`OptimizerBundle.step(ok=...)`: Muon writes momentum and weights where ok, AdamW through torch's fused
kernel with found_inf = !ok), so the trainer launches the optimizer before its one host read. A non-finite step
still changes no weight and no optimizer state (both halt and skip), a finite guarded step equals the plain one,
and the read-after order (the default on CUDA, forced here on the CPU) trains like the read-before order."""
import copy
import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nagmoe.config import load_config
from nagmoe.model import build_model
from nagmoe.train.guards import EXIT_NONFINITE, TrainingHalted
from nagmoe.train.optim import Muon, build_optimizers

# fused and unfused AdamW round the same update differently (~1 ulp per element): after a few steps the tensors
# stay within this, relative in norm (elementwise, a weight near 0 can differ by more than 1e-6 of itself)
ADAMW_RTOL = 1e-6


def rel(a, b):
    return float((a - b).detach().double().norm() / b.detach().double().norm().clamp_min(1e-30))
LOSS_RTOL = 1e-5  # the trainer's losses over 4 steps of the read-after order (its AdamW the fused kernel)


def small_model(impl):
    cfg = load_config("configs/tiny.yaml", [
        "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
        "model.attention.n_heads=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=48",
        "model.ffn=moe", "data.seq_len=64"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return model, build_optimizers(model, dataclasses.replace(cfg.train, muon_impl=impl))


def random_grads(model, gen):
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def state_of(model, bundle):
    """Every parameter and every optimizer state tensor (and step count), copied."""
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {id_: copy.deepcopy(s) for id_, s in enumerate(
                [opt.state[p] for opt in bundle for g in opt.param_groups for p in g["params"]])})


def assert_bitwise_same(before, after):
    (params_a, state_a), (params_b, state_b) = before, after
    for name, value in params_a.items():
        assert torch.equal(value, params_b[name]), f"{name} changed"
    for k, per_param in state_a.items():
        assert per_param.keys() == state_b[k].keys(), k
        for key, value in per_param.items():
            assert torch.equal(value, state_b[k][key]), (k, key)


def guard_flag(loss_sum, model):
    """The trainer's device-side decision: isfinite(loss + aux) & isfinite(the clipped global grad norm)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return torch.isfinite(torch.as_tensor(loss_sum, dtype=torch.float64)) & torch.isfinite(norm.double())


@pytest.mark.parametrize("impl", ["loop", "stacked"])
@pytest.mark.parametrize("plant", ["nan_grad_muon", "nan_grad_adamw", "inf_grad_norm", "nan_loss"])
def test_a_nonfinite_step_changes_nothing(impl, plant):
    model, bundle = small_model(impl)
    gen = torch.Generator().manual_seed(1)
    random_grads(model, gen)
    bundle.step()  # state exists from here on (momentum, AdamW moments, step counts 1)
    random_grads(model, gen)
    named = dict(model.named_parameters())
    loss = 3.0
    if plant == "nan_grad_muon":  # a NaN in one expert stack's gradient
        named["blocks.0.ffn.w_in"].grad[1, 2, 3] = float("nan")
    elif plant == "nan_grad_adamw":  # in the embedding's
        named["wte.weight"].grad[5, 0] = float("nan")
    elif plant == "inf_grad_norm":  # a finite loss but an infinite gradient norm
        named["blocks.1.attn.c_q.weight"].grad[0, 0] = float("inf")
    else:  # a non-finite loss, every gradient finite
        loss = float("nan")
    before = state_of(model, bundle)
    ok = guard_flag(loss, model)
    assert not bool(ok)
    bundle.step(ok=ok)
    assert_bitwise_same(before, state_of(model, bundle))  # weights, momenta, moments, step counts
    assert all(bundle.by_kind["adamw"].state[p]["step"] == 1 for g in bundle.by_kind["adamw"].param_groups
               for p in g["params"])  # today's skip: the count did not move
    assert all(g["fused"] is None for g in bundle.by_kind["adamw"].param_groups)  # checkpoints keep the flag


@pytest.mark.parametrize("impl", ["loop", "stacked"])
def test_a_skipped_first_step_leaves_fresh_state(impl):
    model, bundle = small_model(impl)
    random_grads(model, torch.Generator().manual_seed(2))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    bundle.step(ok=torch.tensor(False))
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    for opt in bundle:  # what a first step then finds is what it would have created: zeros, count 0
        for state in opt.state.values():
            assert all(torch.count_nonzero(v) == 0 for v in state.values()), state.keys()


@pytest.mark.parametrize("impl", ["loop", "stacked"])
def test_a_finite_guarded_step_equals_the_plain_step(impl):
    plain_model, plain = small_model(impl)
    guarded_model, guarded = small_model(impl)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        random_grads(plain_model, gen_a)
        random_grads(guarded_model, gen_b)
        plain.step()
        guarded.step(ok=torch.tensor(True))
    muon_names = set(plain.muon_param_names())
    for (name, p), q in zip(plain_model.named_parameters(), guarded_model.parameters()):
        if name in muon_names:  # the same ops out of place, then where(ok, new, old): bitwise
            assert torch.equal(p, q), name
        else:
            assert rel(q, p) <= ADAMW_RTOL, (name, rel(q, p))
    for opt_a, opt_b in zip(plain, guarded):
        for pa, pb in zip(opt_a.state, opt_b.state):
            for key, value in opt_a.state[pa].items():
                if isinstance(opt_a, Muon):
                    assert torch.equal(value, opt_b.state[pb][key])
                else:  # step counts equal, moments within the fused kernel's rounding
                    assert rel(opt_b.state[pb][key], value) <= ADAMW_RTOL, key


# ------------------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------------------
class Probe(TorchFunctionMode):
    """Logs, in order, the optimizer's step (wrapped) and every host read `tolist` (the step's metrics read)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.log.append("read")
        return func(*args, **(kwargs or {}))


def probe_order(trainer):
    log = []
    step = trainer.optim.step

    def logged_step(*a, **kw):
        log.append("step")
        return step(*a, **kw)

    trainer.optim.step = logged_step
    with Probe(log):
        trainer.train_step()
    del trainer.optim.step
    return log


def test_read_after_launches_the_optimizer_before_the_metrics_read(make_trainer, tmp_path):
    after = make_trainer(run_dir=str(tmp_path / "after"))
    after.metrics_read_after = True
    log = probe_order(after)
    assert "step" in log and "read" in log and log.index("step") < log.index("read"), log
    before = make_trainer(run_dir=str(tmp_path / "before"))  # the CPU's default: read, then step
    log = probe_order(before)
    assert log.index("read") < log.index("step"), log


def test_read_after_trains_like_read_before(make_trainer, tmp_path):
    runs = {}
    for order in (False, True):
        trainer = make_trainer("model.ffn=moe", run_dir=str(tmp_path / f"run_{order}"))
        trainer.metrics_read_after = order
        runs[order] = [trainer.train_step() for _ in range(4)]
    a, b = runs[False], runs[True]
    assert a[0]["loss"] == b[0]["loss"] and a[0]["grad_norm"] == b[0]["grad_norm"]  # before any update: bitwise
    for ra, rb in zip(a, b):
        for key in ("loss", "aux_loss", "grad_norm", "moe_max_over_mean"):
            assert rb[key] == pytest.approx(ra[key], rel=LOSS_RTOL), (key, ra[key], rb[key])
    assert a[-1]["loss"] < a[0]["loss"]


def nan_output_hook(module, inputs, output):
    y, *rest = output
    return (y * float("nan"), *rest)


def trainer_state(trainer):
    return (copy.deepcopy(trainer.model.state_dict()), [copy.deepcopy(o.state_dict()) for o in trainer.optim])


def assert_trainer_state_same(before, after):
    (model_a, optim_a), (model_b, optim_b) = before, after
    for name, value in model_a.items():
        assert torch.equal(value, model_b[name]), f"{name} changed on a non-finite step"
    for a, b in zip(optim_a, optim_b):
        # the schedule sets the next step's lr before the step fails; every other setting (fused included) kept
        assert [{k: v for k, v in g.items() if k != "lr"} for g in a["param_groups"]] == \
            [{k: v for k, v in g.items() if k != "lr"} for g in b["param_groups"]]
        for pid, per_param in a["state"].items():
            for key, value in per_param.items():
                assert torch.equal(value, b["state"][pid][key]), (pid, key)


def test_read_after_halt_touches_nothing_and_says_the_same(make_trainer, tmp_path):
    messages = {}
    for order in (False, True):
        trainer = make_trainer("model.ffn=moe", run_dir=str(tmp_path / f"halt_{order}"))
        trainer.metrics_read_after = order
        trainer.train_step()
        before = trainer_state(trainer)
        list(trainer.model.sublayers())[3].register_forward_hook(nan_output_hook)
        with pytest.raises(TrainingHalted) as halted:
            trainer.train_step()
        assert halted.value.code == EXIT_NONFINITE
        assert_trainer_state_same(before, trainer_state(trainer))  # a save after the halt sees the old state
        assert trainer.progress.step == 1
        messages[order] = halted.value.message
    assert messages[True] == messages[False]
    assert "first non-finite output: sublayer 3: block 1 ffn (MoELayer)" in messages[True]


@pytest.mark.parametrize("plant", ["nan_forward", "inf_gradient"])
def test_read_after_skip_counts_it_and_touches_nothing(make_trainer, tmp_path, plant):
    trainer = make_trainer("train.nonfinite=skip", "model.ffn=moe", "model.moe.expert_bias=true",
                           run_dir=str(tmp_path / "skip"))
    trainer.metrics_read_after = True
    trainer.train_step()
    before = trainer_state(trainer)  # the expert bias is a buffer: update_bias must not run on a skip
    if plant == "nan_forward":
        handle = list(trainer.model.sublayers())[2].register_forward_hook(nan_output_hook)
    else:  # a finite loss, an infinite gradient norm
        handle = trainer.model.lm_head.weight.register_hook(lambda g: g * float("inf"))
    rec = trainer.train_step()
    handle.remove()
    assert rec["nonfinite_skipped"] == 1 and trainer.progress.nonfinite_skipped == 1
    if plant == "inf_gradient":
        assert math.isfinite(rec["loss"]) and not math.isfinite(rec["grad_norm"])
    assert_trainer_state_same(before, trainer_state(trainer))
    assert all(p.grad is None for p in trainer.model.parameters())
    rec = trainer.train_step()  # the next step trains
    assert rec["nonfinite_skipped"] == 1 and rec["loss"] == rec["loss"]
    assert any(not torch.equal(v, trainer.model.state_dict()[k]) for k, v in before[0].items())
