"""The paired difference of two runs over validation windows (nagmoe/analysis/paired.py): the estimate is the
difference of the runs' bpb on the common windows, the interval has its stated coverage, and pairing refuses what
does not pair."""
import math

import numpy as np
import pytest

from nagmoe.analysis.paired import NotPaired, bootstrap_ci, paired_difference, tokens_to_resolve, verdict
from nagmoe.eval.val_windows import WindowLosses

LN2 = math.log(2)


def windows(nats, n_bytes, ids=None, fingerprint="f" * 16, seq_len=256, tokens=None):
    n = len(nats)
    ids = np.arange(n, dtype=np.int64) * 3 if ids is None else np.asarray(ids, dtype=np.int64)
    tokens = np.full(n, seq_len, dtype=np.int64) if tokens is None else tokens
    return WindowLosses(fingerprint, seq_len, "strided", int(ids[-1]) + 1, ids, np.asarray(nats, dtype=np.float64),
                        np.asarray(n_bytes, dtype=np.int64), tokens)


def population(n, delta, seed=0, spread=0.3, noise=0.02):
    """Windows with document-to-document variation (bpb 1.8 ± spread) common to both models, and a model
    difference of `delta` bpb per window ± `noise`: (reference nats, variant nats, bytes)."""
    rng = np.random.default_rng(seed)
    n_bytes = rng.integers(500, 1100, size=n)
    bpb_ref = 1.8 + spread * rng.standard_normal(n)
    bpb_var = bpb_ref + delta + noise * rng.standard_normal(n)
    return bpb_ref * LN2 * n_bytes, bpb_var * LN2 * n_bytes, n_bytes


def test_the_difference_is_the_bpb_difference_on_the_common_windows_and_swapping_negates_it():
    ref, var, n_bytes = population(400, delta=0.01)
    a, b = windows(ref, n_bytes), windows(var, n_bytes)
    p = paired_difference([(a, b)])
    assert p["difference_bpb"] == pytest.approx(b.bpb - a.bpb, rel=1e-12)
    assert p["ci95_bpb"][0] < b.bpb - a.bpb < p["ci95_bpb"][1] and p["ci95_bpb"][0] > 0
    swapped = paired_difference([(b, a)])
    assert swapped["difference_bpb"] == pytest.approx(-p["difference_bpb"], rel=1e-12)
    assert swapped["ci95_bpb"] == pytest.approx([-p["ci95_bpb"][1], -p["ci95_bpb"][0]], rel=1e-12)
    same = paired_difference([(a, a)])
    assert same["difference_bpb"] == 0.0 and same["ci95_bpb"][1] - same["ci95_bpb"][0] < 1e-9


def test_pairing_cancels_the_document_variation_an_unpaired_error_would_carry():
    """The paired standard error is set by the models' difference per window (noise 0.02), not by how hard the
    documents are (spread 0.3): it is >10x below the unpaired one on the same windows."""
    ref, var, n_bytes = population(400, delta=0.01)
    p = paired_difference([(windows(ref, n_bytes), windows(var, n_bytes))])
    per_window = lambda nats: nats / (LN2 * n_bytes)  # noqa: E731
    unpaired = math.sqrt(np.var(per_window(ref), ddof=1) / 400 + np.var(per_window(var), ddof=1) / 400)
    assert p["se_bpb"] * 10 < unpaired


def test_the_interval_covers_the_population_difference_95_percent_of_the_time():
    """200 samples of 300 windows from a 30,000-window population (a fixed seed: deterministic); the delta-method
    interval must cover the population's difference in 90-99% of them (binomial sd ~1.5% around 95%), and the
    bootstrap's interval must agree with it within 10% of its width."""
    ref, var, n_bytes = population(30_000, delta=0.004, noise=0.05)
    truth = (var.sum() - ref.sum()) / (LN2 * n_bytes.sum())
    rng = np.random.default_rng(1)
    covered, widths = 0, []
    for rep in range(200):
        take = np.sort(rng.choice(30_000, size=300, replace=False))
        pair = [(windows(ref[take], n_bytes[take], take), windows(var[take], n_bytes[take], take))]
        lo, hi = paired_difference(pair)["ci95_bpb"]
        covered += lo <= truth <= hi
        if rep < 5:
            blo, bhi = bootstrap_ci(pair)
            widths.append(((hi - lo), (bhi - blo)))
    assert 0.90 <= covered / 200 <= 0.99, covered
    for delta_width, boot_width in widths:
        assert abs(delta_width - boot_width) < 0.1 * delta_width


def test_seeds_pool_as_the_difference_of_the_seed_means_on_the_common_windows():
    r0, v0, n_bytes = population(200, delta=0.01, seed=0)
    r1, v1, _ = population(200, delta=0.03, seed=1)
    pairs = [(windows(r0, n_bytes), windows(v0, n_bytes)), (windows(r1, n_bytes), windows(v1, n_bytes))]
    pooled = paired_difference(pairs)
    each = [paired_difference([p])["difference_bpb"] for p in pairs]
    assert pooled["difference_bpb"] == pytest.approx(sum(each) / 2, rel=1e-12)
    assert pooled["seeds"] == 2 and pooled["windows"] == 200


def test_only_the_same_windows_pair():
    ref, var, n_bytes = population(100, delta=0.01)
    a = windows(ref, n_bytes)
    with pytest.raises(NotPaired, match="no common windows"):  # B scored other windows: nothing to pair
        paired_difference([(a, windows(var, n_bytes, ids=np.arange(100) * 3 + 1))])
    with pytest.raises(NotPaired, match="other data"):
        paired_difference([(a, windows(var, n_bytes, fingerprint="e" * 16))])
    with pytest.raises(NotPaired, match="seq_len"):
        paired_difference([(a, windows(var, n_bytes, seq_len=128))])
    with pytest.raises(NotPaired, match="other text"):  # same ids, other bytes: not the same windows
        paired_difference([(a, windows(var, n_bytes + 1))])
    # half the windows in common: paired on those, and only those
    half = windows(var[50:], n_bytes[50:], ids=np.arange(50, 100) * 3)
    p = paired_difference([(a, half)])
    assert p["windows"] == 50
    assert p["difference_bpb"] == pytest.approx((var[50:].sum() - ref[50:].sum()) / (LN2 * n_bytes[50:].sum()))


def test_tokens_to_resolve_scale_as_the_inverse_square_of_the_claim():
    ref, var, n_bytes = population(400, delta=0.01)
    p = paired_difference([(windows(ref, n_bytes), windows(var, n_bytes))])
    big, small = tokens_to_resolve(p, 0.01), tokens_to_resolve(p, 0.001)
    assert small == pytest.approx(100 * big)
    # at that many tokens the half-width (1.96 se, se ~ 1/sqrt(N)) equals the claim
    assert 1.959963984540054 * p["se_nats_per_token"] * math.sqrt(p["tokens"] / big) == pytest.approx(0.01)


SEEDS_RESOLVE = {"inside_noise": False, "two_se": 0.005, "diff": -0.015}
SEEDS_DO_NOT = {"inside_noise": True, "two_se": 0.05, "diff": -0.015}


@pytest.mark.parametrize("windows_ci, seeds, expected", [
    ([-0.02, -0.01], SEEDS_RESOLVE, "resolved by the windows and the seeds"),
    ([-0.02, -0.01], SEEDS_DO_NOT, "resolved by the windows, not by the seeds"),
    ([-0.02, 0.01], SEEDS_RESOLVE, "resolved by the seeds, not by the windows"),
    ([-0.02, 0.01], SEEDS_DO_NOT, "resolved by neither"),
    ([-0.02, -0.01], {"inside_noise": None, "diff": -0.015}, "resolved by the windows: nag ahead"),
])
def test_the_verdict_names_what_resolves_the_difference(windows_ci, seeds, expected):
    paired = {"difference_bpb": -0.015, "ci95_bpb": windows_ci, "resolves_bpb": 0.005}
    text = verdict(paired, seeds, ("nag", "baseline"))["text"]
    assert text.startswith(expected), text
    assert "windows resolve differences above 0.0050 bpb" in text


def test_windows_without_text_do_not_pair():
    """A kept file may be well-formed and still hold 0 bytes everywhere: NotPaired, not a ZeroDivisionError."""
    zeros = np.zeros(10, dtype=np.int64)
    with pytest.raises(NotPaired, match="0 bytes"):
        paired_difference([(windows(np.ones(10), zeros), windows(np.ones(10), zeros))])
