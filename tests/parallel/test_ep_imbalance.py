"""Issue 28, item 3: the all-to-all's balance under MoD on 2 real gloo ranks with parallel.ep=2
(tools/bench_ep_imbalance.py through the Trainer): every row sent is received, full depth sends N·K rows from
every rank, MoD sends only its executed tokens' slots, and the report's imbalance figures are well formed."""
import os
import sys

import pytest

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

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
