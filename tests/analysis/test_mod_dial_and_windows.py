"""MoD readings on a real MoD model (calibrated by one training-mode pass and `mod_update`): the realised skip
rate per sublayer, the compute dial (realised rate follows the dial, executed FLOPs fall with it, the trained
thresholds are restored), "not available" without MoD; and the BOS-aligned validation windows."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from analysis_models import BOS, randomize_outputs, tiny_model, token_batches
from nagmoe.analysis.compute_dial import NOT_AVAILABLE, compute_dial, executed_flops_per_token, realised_skip_rate
from nagmoe.analysis.run_analysis import analyze_model, bos_aligned_rows
from nagmoe.config import MoDConfig


def test_without_mod_the_sections_say_not_available():
    nag = analyze_model(tiny_model("nag"), token_batches(1), bos_id=BOS)
    assert nag["mod"] == NOT_AVAILABLE and nag["compute_dial"] == NOT_AVAILABLE
    assert any("without MoD" in n for n in nag["notes"])
    pre = analyze_model(tiny_model("prenorm"), token_batches(1), bos_id=BOS)
    assert pre["compute_dial"].startswith("not applicable")


@pytest.fixture(scope="module")
def calibrated_mod_model():
    """Tiny NAG model with MoD at 20% on every sublayer (one quantile per sublayer), thresholds calibrated on the
    batches it is analysed on."""
    model = tiny_model("nag", mod=MoDConfig(skip_rate=0.2, sublayers="all", threshold="per_sublayer"))
    randomize_outputs(model)
    batches = token_batches(4, rows=4)
    model.train()
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    model.mod_update()
    return model.eval(), batches


def test_mod_section_and_dial_on_a_calibrated_model(calibrated_mod_model):
    model, batches = calibrated_mod_model
    thresholds = model.mod_calibrator().threshold.clone()
    result = analyze_model(model, batches, bos_id=BOS)
    mod = result["mod"]
    assert mod["target_skip_rate"] == 0.2 and mod["eligible"] == [True] * 4
    # sublayer 0 sees the embeddings, exactly the scores it was calibrated on
    assert mod["skip_rate_per_sublayer"][0] == pytest.approx(0.2, abs=0.03)
    assert 0.05 < mod["realised_skip_rate"] < 0.5
    dial = result["compute_dial"]
    assert [row["skip_rate"] for row in dial] == [0.0, 0.1, 0.2, 0.3, 0.4]
    assert dial[0]["realised_skip_rate"] == 0.0 and dial[0]["flops_vs_full_depth"] == pytest.approx(1.0)
    for row in dial:
        assert row["executed_frac_per_sublayer"][0] == pytest.approx(1 - row["skip_rate"], abs=0.03)
    flops = [row["forward_flops_per_token"] for row in dial]
    assert all(a > b for a, b in zip(flops, flops[1:]))
    assert all(math.isfinite(row["val_loss"]) and row["val_loss"] > 0 for row in dial)
    assert torch.equal(model.mod_calibrator().threshold, thresholds)  # the trained thresholds are back


def test_the_dial_is_exact_on_tokens_it_did_not_calibrate_on():
    """Global thresholds: each rate calibrated on some batches realises the asked work-weighted skip within 2
    points on other batches; without the calibration the histogram quantiles alone miss it."""
    model = tiny_model("nag", mod=MoDConfig(skip_rate=0.2, sublayers="all"))
    randomize_outputs(model)
    batches = token_batches(24, rows=8)
    train, calibration, measured = batches[:4], batches[4:14], batches[14:]
    model.train()
    with torch.no_grad():
        for x, _ in train:
            model(x)
    model.mod_update()
    model.eval()
    dial = analyze_model(model, measured, bos_id=BOS, dial_rates=(0.1, 0.2, 0.4),
                         calibration_batches=calibration)["compute_dial"]
    for row in dial:
        assert abs(row["calibrated_skip_rate"] - row["skip_rate"]) <= 0.01, row
        assert abs(row["realised_skip_rate"] - row["skip_rate"]) <= 0.02, row
    per_sublayer = [row["executed_frac_per_sublayer"] for row in dial]
    assert max(per_sublayer[1]) - min(per_sublayer[1]) > 0.05  # one threshold: sublayers skip differently


def test_compute_dial_counts_executed_flops_of_eligible_sublayers():
    """A constructed dial on the FFN sublayers only: the rate set is realised exactly there."""
    model = tiny_model("nag")
    cfg, state = model.config, {}
    eligible = [False, True, False, True]

    def evaluate():
        r = state["rate"]
        return 3.0 + r, 1.0 + r, {"executed_frac": [1.0, 1.0 - r, 1.0, 1.0 - r]}

    rows = compute_dial(model, cfg, 16, evaluate, lambda m, r: state.update(rate=r), eligible=eligible)
    assert [r["realised_skip_rate"] for r in rows] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert rows[2]["forward_flops_per_token"] == pytest.approx(executed_flops_per_token(cfg, 16, [1, 0.8, 1, 0.8]))
    assert realised_skip_rate([1.0, 0.6, 1.0, 0.8], eligible) == pytest.approx(0.3)
    assert realised_skip_rate([1.0, 0.6]) == pytest.approx(0.2)


def test_bos_aligned_windows_start_at_bos_and_do_not_overlap():
    bos, seq = 0, 4
    a = np.array([5, 0, 1, 2, 0, 3, 4, 5, 6, 0, 7, 0, 8, 9], dtype=np.uint16)
    b = np.array([0, 1, 2, 3, 4, 5, 0], dtype=np.uint16)
    shards = SimpleNamespace(arrays=[a, b], bos_id=bos)
    rows = bos_aligned_rows(shards, seq, max_windows=10)
    # a: BOS at 1 -> [1:6]; BOS at 4 overlaps it; BOS at 9 -> [9:14]; BOS at 11 overlaps; b: BOS at 0 -> [0:5]
    assert rows.tolist() == [[0, 1, 2, 0, 3], [0, 7, 0, 8, 9], [0, 1, 2, 3, 4]]
    assert bos_aligned_rows(shards, seq, max_windows=2).shape == (2, seq + 1)
    assert bos_aligned_rows(shards, 20, max_windows=5).shape == (0, 21)
