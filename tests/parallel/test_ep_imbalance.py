"""Issue 28, item 3: the all-to-all's balance under MoD on 2 real gloo ranks with parallel.ep=2
(tools/bench/bench_ep_imbalance.py through the Trainer): every row sent is received, full depth sends N·K rows from
every rank, MoD sends only its executed tokens' slots, and the report's imbalance figures are well formed.
Issue 43, item 5: the same tool's expert-balancing study (--balance) on 4 ranks."""
import os
import sys

import pytest

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))

pytestmark = pytest.mark.distributed


def measure_on_rank(overrides, work):
    from bench_ep_imbalance import measure

    return measure(os.path.join(REPO, "configs/tiny.yaml"), 4, overrides, work)


def test_traffic_is_conserved_and_mod_sends_only_executed_slots(micro_overrides, tmp_path):
    overrides = [*micro_overrides, "model.mod.skip_rate=0.3", "model.mod.threshold=per_sublayer"]
    results = run_on_ranks(measure_on_rank, 2, overrides, str(tmp_path), timeout=300)
    assert results[0] == results[1]  # gathered: both ranks report the same
    full, mod = results[0]["full_depth"], results[0]["mod"]
    for report in (full, mod):
        assert report["rows_conserved"] and report["steps"] == 4 and report["moe_layers"] == 2
        for key in ("received_max_over_mean", "sent_max_over_mean"):
            s = report[key]
            assert 1.0 <= s["mean"] <= s["p95"] <= s["max"] <= 2.0  # max/mean over 2 ranks lies in [1, 2]
    # full depth: every rank sends all its tokens' top-k slots, so the senders are perfectly even
    assert full["executed_share_of_moe_tokens"] == 1.0 and full["sent_max_over_mean"]["max"] == 1.0
    # MoD: the first step calibrates (every token runs), then ~30% of the MoE tokens stay home
    assert 0.6 < mod["executed_share_of_moe_tokens"] < 0.95


def balance_on_rank(overrides, work):
    from bench_ep_imbalance import measure_balance

    return measure_balance(os.path.join(REPO, "configs/tiny.yaml"), 3, overrides, work, capacity_factors=(None, 1.0),
                           routings=("gamma=0", "gamma=0.01", "round_robin"))


def test_the_balance_study_on_four_ranks(micro_overrides, tmp_path):
    """Issue 43 item 5 (tools/bench/bench_ep_imbalance.py --balance) on 4 gloo ranks, EP=4: the round-robin control is
    exactly even (EP max/mean 1, no slot dropped even at capacity 1.0); a dropless run drops nothing; the receive
    peak is at least every (step, layer)'s EP max/mean; the bias moved only where it is on."""
    overrides = [*micro_overrides, "train.micro_batch_tokens=64", "model.moe.n_experts=8", "model.nag.C=8"]
    results = run_on_ranks(balance_on_rank, 4, overrides, str(tmp_path), timeout=400)
    def counted(r):  # all but the rank's own clock: gathered or all-reduced, the same on every rank
        return {name: {k: v for k, v in variant.items() if k != "step_s"} for name, variant in r.items()}

    assert all(counted(r) == counted(results[0]) for r in results[1:])
    out = results[0]
    assert len(out) == 6
    for name, variant in out.items():
        received = variant["ep_received_max_over_mean"]
        assert 1.0 <= received["mean"] <= received["max"] <= 4.0, name
        assert variant["receive_peak_over_mean"] >= received["max"] - 1e-12, name  # per micro-step >= per step
        assert variant["step_s"] > 0
        if name.endswith("capacity=none"):
            assert variant["dropped_frac"] == 0.0, name
    for factor in ("none", "1.0"):
        control = out[f"round_robin/capacity={factor}"]
        assert control["ep_received_max_over_mean"]["max"] == 1.0 and control["receive_peak_over_mean"] == 1.0
        assert control["expert_max_over_mean_worst_layer"] == 1.0 and control["dropped_frac"] == 0.0
        assert control["bias_range_max"] is None and out[f"gamma=0/capacity={factor}"]["bias_range_max"] is None
        assert out[f"gamma=0.01/capacity={factor}"]["bias_range_max"] > 0
