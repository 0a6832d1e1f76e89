"""Depth statistics on constructed cases with known answers: sublayers that write nothing give zero rotation
and a flat norm curve; NAG gates pinned open (m = 1) rotate by exactly arctan(alpha) and grow the log-norm by
½·log1p(alpha²); constant norms give a flat curve."""
import math

import pytest
import torch

from analysis_models import BOS, token_batches, tiny_model, randomize_outputs
from nagmoe.analysis.depth import (StatsAverager, cumulative_rotation, depth_report, norm_curve, quartile_means)
from nagmoe.analysis.run_analysis import analyze_model


@pytest.mark.parametrize("residual, attention, ffn", [
    ("nag", "mha", "dense"), ("nag", "cca", "moe"), ("prenorm", "mha", "dense"), ("prenorm", "cca", "moe")])
def test_sublayers_that_write_nothing_give_zero_rotation_and_a_flat_norm_curve(residual, attention, ffn):
    model = tiny_model(residual, attention, ffn)  # zero output projections: every sublayer writes 0
    depth = analyze_model(model, token_batches(), bos_id=BOS)["depth"]
    assert max(abs(a) for a in depth["rotation_per_sublayer"]) < 1e-5
    assert depth["cumulative_rotation"] == pytest.approx([0.0] * 5, abs=2e-5)
    curve = depth["norm_curve"]
    assert len(curve) == 5 and curve == pytest.approx([curve[0]] * 5, rel=1e-6)
    assert depth["norm_growth"] == pytest.approx(1.0, abs=1e-6)


def test_nag_gates_pinned_open_rotate_by_arctan_alpha():
    model = tiny_model("nag")
    randomize_outputs(model)  # every sublayer writes a non-zero f, so u has unit RMS
    alphas = [0.5, 0.01, 2.0, 0.3]
    with torch.no_grad():
        for gate, alpha in zip(model.stream.gates, alphas):
            gate.weight.zero_()
            gate.bias.fill_(40.0)  # sigmoid = 1, so m = 1 and the gain is alpha for every token
            gate.alpha.fill_(alpha)
    depth = analyze_model(model, token_batches(), bos_id=BOS)["depth"]
    assert depth["rotation_per_sublayer"] == pytest.approx([math.atan(a) for a in alphas], abs=1e-4)
    assert depth["cumulative_rotation"][-1] == pytest.approx(sum(math.atan(a) for a in alphas), abs=4e-4)
    steps = [b - a for a, b in zip(depth["log_norm_curve"], depth["log_norm_curve"][1:])]
    assert steps == pytest.approx([0.5 * math.log1p(a * a) for a in alphas], abs=1e-5)
    rows = depth["sublayers"]
    assert [r["gain_mean"] for r in rows] == pytest.approx(alphas, rel=1e-5)
    assert [r["dead_frac"] for r in rows] == [0.0, 1.0, 0.0, 0.0]  # gain < 0.05
    assert [r["on_frac"] for r in rows] == [1.0, 0.0, 1.0, 1.0]  # gain > 0.25
    assert depth["dead_sublayers"] == 1 and depth["dead_sublayer_fraction"] == 0.25
    assert [r["kind"] for r in rows] == ["attention", "ffn", "attention", "ffn"]


def test_norm_curve_from_stats():
    flat = {"log_norm_in": [0.7] * 3, "log_norm_out": [0.7] * 3}
    assert norm_curve(flat, "nag") == pytest.approx([math.exp(0.7)] * 4)
    grows = {"log_norm_in": [0.0, math.log(2)], "log_norm_out": [math.log(2), math.log(3)]}
    assert norm_curve(grows, "nag") == pytest.approx([1.0, 2.0, 3.0])
    prenorm = {"stream_rms_in": [1.0, 1.5], "stream_rms_out": [1.5, 4.0]}
    assert norm_curve(prenorm, "prenorm") == [1.0, 1.5, 4.0]
    report = depth_report({**prenorm, "log_norm_in": [0.0, 0.4], "log_norm_out": [0.4, 1.4],
                           "rotation_angle": [0.1, 0.2]}, "prenorm")
    assert report["norm_growth"] == 4.0 and report["cumulative_rotation"] == pytest.approx([0.0, 0.1, 0.3])


def test_helpers():
    assert cumulative_rotation([0.1, 0.2, 0.3]) == pytest.approx([0.0, 0.1, 0.3, 0.6])
    assert quartile_means([1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]) == [2.0, 6.0, 10.0, 14.0]
    assert quartile_means([1.0, None, 5.0, 7.0]) == [1.0, None, 5.0, 7.0]
    avg = StatsAverager()
    avg.add({"gain_mean": [1.0, 2.0], "m_min": [0.3, 0.5], "g_encode": 1.0}, 10)
    avg.add({"gain_mean": [3.0, 4.0], "m_min": [0.4, 0.1], "g_encode": 4.0}, 30)
    assert avg.mean() == {"gain_mean": [2.5, 3.5], "m_min": [0.3, 0.1], "g_encode": 3.25}
