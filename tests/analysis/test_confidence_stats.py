"""Confidence statistics: Spearman on constructed orderings (with ties), equal-count bins, entropy of known
distributions, and the captured final NAG log-norm agrees with the model's own last-sublayer statistic."""
import math

import numpy as np
import pytest
import torch

from analysis_models import BOS, randomize_outputs, tiny_model, token_batches
from nagmoe.analysis.capture import decode_state
from nagmoe.analysis.confidence import average_ranks, binned, confidence_report, entropy_from_logits, spearman
from nagmoe.analysis.run_analysis import analyze_model, measure


def test_spearman_on_known_orderings():
    x = np.arange(20.0)
    assert spearman(x, x ** 3) == pytest.approx(1.0)
    assert spearman(x, -np.exp(x)) == pytest.approx(-1.0)
    assert spearman(x, np.ones(20)) is None and spearman([1.0], [2.0]) is None
    assert list(average_ranks([10, 20, 20, 30])) == [1.0, 2.5, 2.5, 4.0]
    # binary y with ties: Pearson of the average ranks, by hand
    xs, ys = [1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1]
    rx, ry = np.array([1, 2, 3, 4.0]), np.array([1.5, 1.5, 3.5, 3.5])
    rx, ry = rx - rx.mean(), ry - ry.mean()
    assert spearman(xs, ys) == pytest.approx((rx @ ry) / math.sqrt((rx @ rx) * (ry @ ry)))


def test_equal_count_bins_follow_the_signal():
    rng = np.random.default_rng(0)
    signal = rng.permutation(100).astype(float)
    loss = 10.0 - signal / 10.0
    correct = signal >= 50
    bins = binned(signal, loss, correct, n_bins=4)
    assert [b["tokens"] for b in bins] == [25] * 4
    assert [b["top1_acc"] for b in bins] == [0.0, 0.0, 1.0, 1.0]
    assert [b["loss"] for b in bins] == pytest.approx([10 - 1.2, 10 - 3.7, 10 - 6.2, 10 - 8.7])
    assert bins[0]["lo"] == 0.0 and bins[-1]["hi"] == 99.0
    report = confidence_report(signal, loss, correct, n_bins=4)
    assert report["spearman_loss"] == pytest.approx(-1.0) and report["spearman_top1"] > 0.8


def test_entropy_of_known_distributions():
    V = 50
    logits = torch.zeros(2, 3, V)
    assert torch.allclose(entropy_from_logits(logits), torch.full((2, 3), math.log(V)))
    logits[..., 7] = 1e4
    assert torch.allclose(entropy_from_logits(logits), torch.zeros(2, 3), atol=1e-5)


def test_final_log_norm_is_the_state_the_model_decodes():
    model = tiny_model("nag", "cca", "moe")
    randomize_outputs(model)
    batches = token_batches()
    m = measure(model, batches, "cpu", BOS)
    final = m.tokens.get("final_log_norm")
    assert len(final) == sum(y.numel() for _, y in batches)
    assert final.mean() == pytest.approx(m.stats.mean()["log_norm_out"][-1], rel=1e-5)
    with torch.no_grad(), decode_state(model) as decoded:
        logits = model(batches[0][0]).logits
    assert "decode" not in vars(model.stream)  # the recording wrapper is gone afterwards
    # the NAG decode: logits = exp(s)·cos(R, W[v]) is at most exp(s) in size
    bound = decoded.last.log_norm_BT.exp().unsqueeze(-1)
    assert (logits.abs() <= bound * (1 + 1e-5)).all() and (logits.abs().amax(-1) > 0.1 * bound.squeeze(-1)).all()


def test_confidence_sections_per_residual():
    nag = analyze_model(tiny_model("nag"), token_batches(), bos_id=BOS, n_bins=3)["confidence"]
    pre = analyze_model(tiny_model("prenorm"), token_batches(), bos_id=BOS, n_bins=3)["confidence"]
    assert set(nag) == {"entropy", "final_log_norm"} and set(pre) == {"entropy"}
    assert sum(b["tokens"] for b in nag["final_log_norm"]["bins"]) == nag["entropy"]["tokens"] == 2 * 3 * 16
