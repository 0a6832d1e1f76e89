"""Issue 22, behaviour: the LM loss alone teaches a top-1 router under NAG as under pre-norm
(nagmoe/analysis/routing_probe.py: experts made class specialists, then a fresh router trained alone, balancing
losses off, 3 seeds), also with the loss-free expert bias on. The legacy form (gate_grad=none) is the negative control: it must fail the same bound,
so the test cannot pass on the code before the fix."""
import pytest
import torch

from nagmoe.analysis.routing_probe import CHANCE, probe

SEEDS = (0, 1, 2)


def _mean(runs, key):
    return sum(r[key] for r in runs) / len(runs)


@pytest.fixture(scope="module")
def results():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {variant: [probe(residual, gate_grad, seed, oracle_steps=300, router_steps=100, bias_update_rate=rate)
                          for seed in SEEDS]
                for variant, (residual, gate_grad, rate) in {"prenorm": ("prenorm", "step_gain", None),
                                                             "nag": ("nag", "step_gain", None),
                                                             "nag_legacy": ("nag", "none", None),
                                                             "nag_bias": ("nag", "step_gain", 1e-3)}.items()}
    finally:
        torch.set_num_threads(threads)


def test_nag_top1_router_learns_like_prenorm(results):
    pre, nag = results["prenorm"], results["nag"]
    pre_acc, nag_acc = _mean(pre, "routing_accuracy"), _mean(nag, "routing_accuracy")
    assert pre_acc >= CHANCE + 0.3, f"the task is not learnable even under pre-norm: {pre}"
    assert nag_acc >= 0.9 * pre_acc, (nag_acc, pre_acc)
    assert min(r["routing_accuracy"] for r in nag) >= CHANCE + 0.3, nag
    # "within 2% at the same step": NAG's held-out loss is not worse than pre-norm's by more than 2%
    assert _mean(nag, "loss") <= 1.02 * _mean(pre, "loss"), (nag, pre)


def test_the_bound_holds_with_the_expert_bias(results):
    """Issue 43: with the loss-free bias at DeepSeek's γ = 1e-3 (updated every router step from its counts) the
    router still learns to NAG's bound. (At γ = 1e-2 it does not on 2 of 3 seeds, while pre-norm does:
    docs/benchmarks.md, router learning with the expert bias.)"""
    pre, biased = results["prenorm"], results["nag_bias"]
    assert _mean(biased, "routing_accuracy") >= 0.9 * _mean(pre, "routing_accuracy"), biased
    assert min(r["routing_accuracy"] for r in biased) >= CHANCE + 0.3, biased
    assert _mean(biased, "loss") <= 1.02 * _mean(pre, "loss"), (biased, pre)


def test_legacy_gate_form_fails_the_same_bound(results):
    legacy = _mean(results["nag_legacy"], "routing_accuracy")
    assert legacy < CHANCE + 0.3, results["nag_legacy"]
    assert _mean(results["nag_legacy"], "loss") > 1.02 * _mean(results["prenorm"], "loss")
