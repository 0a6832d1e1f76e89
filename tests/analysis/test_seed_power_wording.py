"""Issue 24: the report words each comparison by what its seeds resolve — the difference, its seed standard
error and the smallest difference the seeds resolve (two standard errors) — on both sides of that line."""
import math

import pytest

from types import SimpleNamespace

from nagmoe.analysis.report_paired import comparisons_html, pair_statistics
from nagmoe.analysis.report_data import Pair, noise_statement


def group(val_loss):
    return {"val_bpb": [v / math.log(2) for v in val_loss], "val_loss": val_loss, "eval_accuracy": [],
            "eval_items": 0, "tokens": [1e6] * len(val_loss)}


def test_a_resolved_difference_reads_ahead_by_with_its_standard_error():
    baseline, nag = [3.000, 3.004, 2.996], [2.979, 2.981, 2.977]  # NAG 0.021 nats ahead, sd 0.004 / 0.002
    out = noise_statement(baseline, nag, "val loss", " nats", names=("nag", "baseline"))
    se = math.sqrt(0.004 ** 2 / 3 + 0.002 ** 2 / 3)
    assert out["se"] == pytest.approx(se) and out["two_se"] == pytest.approx(2 * se) and not out["inside_noise"]
    assert out["text"].startswith(f"nag ahead of baseline by 0.0210 ± {se:.4f} nats")
    assert f"resolve differences above {2 * se:.4f} nats" in out["text"]
    behind = noise_statement(nag, baseline, "val loss", " nats", names=("baseline", "nag"))
    assert behind["text"].startswith("baseline behind nag by 0.0210")


def test_a_difference_below_two_standard_errors_says_the_seeds_cannot_resolve_it():
    full, mod = [3.000, 3.010, 2.990], [3.001, 2.991, 3.011]  # MoD 0.001 behind, sd 0.01
    out = noise_statement(full, mod, "val loss", " nats", names=("nag-mod20", "nag"))
    assert out["inside_noise"]
    assert out["text"].startswith("below what 3 seeds resolve: |difference| 0.0010 nats <")
    assert f"{out['two_se']:.4f} nats, the smallest difference they resolve" in out["text"]


def test_the_comparisons_section_carries_both_wordings():
    nums = {"baseline": group([3.000, 3.004, 2.996]), "nag": group([2.979, 2.981, 2.977]),
            "nag-mod20": group([2.980, 2.970, 2.990])}
    pairs = [Pair("nag_vs_baseline", "baseline", "nag", []), Pair("mod_vs_full", "nag", "nag-mod20", [])]
    groups = {g: [SimpleNamespace(seed=s, windows=None, windows_note=None, label=f"{g}-s{s}") for s in range(3)]
              for g in nums}  # run records without per-window losses: the seed statement alone, "not paired"
    html = comparisons_html(pairs, [pair_statistics(p, groups, nums) for p in pairs], nums, "")
    assert "not paired: " in html
    assert "nag ahead of baseline by 0.0210 ±" in html
    assert "below what 3 seeds resolve" in html
