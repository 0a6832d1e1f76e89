"""Paired differences of two runs on the same validation windows (issue 66), and the verdict worded by what the
windows and the seeds resolve.

Two runs that scored the same windows (same data fingerprint, seq_len and window ids: nagmoe/eval/val_windows.py)
differ on window w by d_w = (nats_B,w - nats_A,w) / ln 2 bits over the window's b_w bytes (the same text, so the
same bytes). Their bpb difference on those windows is the ratio

    D = Σ_w d_w / Σ_w b_w                                  (= bpb_B - bpb_A on the common windows, exactly)

Most of the window-to-window variation (easy and hard documents) is common to both models and cancels in d_w:
that is what pairing buys. With several seeds, d_w is the mean over the seed pairs (A-sS, B-sS) of their
differences, so the pooled D is the difference of the seed means on those windows.

Interval (`method = "delta"`): windows are the independent units (the strided sample spaces them over the whole
split, nagmoe/data/eval_sample.py), and D is a ratio of two sums over them; linearised (the delta method),

    se(D)² = n/(n-1) · Σ_w (d_w - D·b_w)² / (Σ_w b_w)²,     95% interval D ± 1.96·se(D).

Why the delta method and not a bootstrap: it is closed form and deterministic, O(n) at millions of windows, and
exactly 0 wide for identical models; `bootstrap_ci` (fixed seed, 2,000 resamples of windows) is kept as its
check, and the two agree within a few percent on the demo's windows (tests/analysis/test_paired.py,
docs/benchmarks.md). The interval is the eval-sample error of these trained models only: the training noise is
what the seeds measure (nagmoe/analysis/report_data.py `noise_statement`); the verdict names both.

The same ratio with tokens as the denominator gives the difference in nats per token, the paper's unit; the
tokens a claim c needs to be resolved at 1.96 standard errors are N·(1.96·se_tok / c)² (se shrinks as 1/sqrt(N)).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile
LN2 = math.log(2)
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0
METHOD = "delta"  # the delta method on the ratio of sums over windows (module docstring)


class NotPaired(Exception):
    """Two runs' window losses cannot be paired; str() says why, in one line."""


def common_windows(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Indices into a and b (WindowLosses) of the windows both scored; NotPaired when they cannot pair."""
    if a.data_fingerprint != b.data_fingerprint:
        raise NotPaired(f"scored on other data (fingerprints {a.data_fingerprint[:16]} vs {b.data_fingerprint[:16]})")
    if a.seq_len != b.seq_len:
        raise NotPaired(f"scored windows of another length (seq_len {a.seq_len} vs {b.seq_len})")
    if a.split != b.split:
        raise NotPaired(f"scored other splits ({a.split[:20]} vs {b.split[:20]})")
    common, ia, ib = np.intersect1d(a.window_ids, b.window_ids, assume_unique=True, return_indices=True)
    if len(common) < 2:
        raise NotPaired(f"no common windows to pair ({len(common)} of {len(a.window_ids)} and {len(b.window_ids)}: "
                        "other eval samples)")
    if not np.array_equal(a.bytes[ia], b.bytes[ib]) or not np.array_equal(a.tokens[ia], b.tokens[ib]):
        raise NotPaired("the same window ids hold other text (bytes per window differ)")
    return ia, ib


def ratio_and_se(d: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """(Σd / Σden, its delta-method standard error over the n units)."""
    n, total = len(d), float(den.sum())
    estimate = float(d.sum()) / total
    resid = d - estimate * den
    se = math.sqrt(n / (n - 1) * float(np.dot(resid, resid))) / total
    return estimate, se


def _aligned(seed_pairs: list) -> tuple:
    """(per-window mean nats difference B - A, bytes, tokens, reference nats by seed, variant nats by seed) on the
    windows that every run of `seed_pairs` scored; NotPaired when fewer than two."""
    if not seed_pairs:
        raise NotPaired("no seed has both runs' window losses")
    ref0 = seed_pairs[0][0]
    ids = ref0.window_ids
    for a, b in seed_pairs:
        for other in (a, b):
            ia, _ = common_windows(ref0, other)
            ids = np.intersect1d(ids, ref0.window_ids[ia], assume_unique=True)
    if len(ids) < 2:
        raise NotPaired(f"the seeds share {len(ids)} common windows")
    def at(run):  # positions of `ids` in the run's ascending ids, each checked to be that id
        pos = np.minimum(np.searchsorted(run.window_ids, ids), len(run.window_ids) - 1)
        if not np.array_equal(run.window_ids[pos], ids):
            raise NotPaired("a run lacks windows the others share")
        return pos

    at0 = at(ref0)
    if int(ref0.bytes[at0].sum()) == 0:
        raise NotPaired("the common windows hold no text (0 bytes)")
    ref_nats = [a.nats[at(a)] for a, _ in seed_pairs]
    var_nats = [b.nats[at(b)] for _, b in seed_pairs]
    nats_d = np.mean([vb - va for va, vb in zip(ref_nats, var_nats)], axis=0)
    return nats_d, ref0.bytes[at0].astype(np.float64), ref0.tokens[at0].astype(np.float64), ref_nats, var_nats


def paired_difference(seed_pairs: list) -> dict:
    """The pooled paired difference B - A over the windows every (reference A, variant B) pair of `seed_pairs`
    scored (one pair per seed). NotPaired when they share fewer than two windows."""
    nats_d, n_bytes, n_tokens, ref_nats, var_nats = _aligned(seed_pairs)
    diff, se = ratio_and_se(nats_d / LN2, n_bytes)
    diff_tok, se_tok = ratio_and_se(nats_d, n_tokens) if n_tokens.sum() > 0 else (float("nan"), float("nan"))
    half, denom = Z95 * se, LN2 * float(n_bytes.sum())
    return {"difference_bpb": diff, "ci95_bpb": [diff - half, diff + half], "se_bpb": se, "resolves_bpb": half,
            "windows": int(len(nats_d)), "tokens": int(n_tokens.sum()), "bytes": int(n_bytes.sum()),
            "method": METHOD, "seeds": len(seed_pairs), "difference_nats_per_token": diff_tok,
            "se_nats_per_token": se_tok, "reference_bpb": float(np.mean([v.sum() for v in ref_nats])) / denom,
            "variant_bpb": float(np.mean([v.sum() for v in var_nats])) / denom}


def bootstrap_ci(seed_pairs: list, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> list:
    """[lo, hi], the 2.5% and 97.5% quantiles of D over `resamples` resamples of the common windows (fixed seed):
    the check of the delta method's interval."""
    nats_d, n_bytes, _, _, _ = _aligned(seed_pairs)
    d = nats_d / LN2
    draws = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.quantile(d[draws].sum(axis=1) / n_bytes[draws].sum(axis=1), [0.025, 0.975])
    return [float(lo), float(hi)]


def tokens_to_resolve(paired: dict, claim_nats_per_token: float) -> Optional[float]:
    """Tokens at which the 95% interval's half-width reaches `claim` (nats per token), from this sample's
    per-token standard error: N·(1.96·se / claim)²."""
    se = paired.get("se_nats_per_token")
    if se is None or not math.isfinite(se) or claim_nats_per_token <= 0:
        return None
    return paired["tokens"] * (Z95 * se / claim_nats_per_token) ** 2


def verdict(paired: Optional[dict], seeds: dict, names: tuple) -> dict:
    """Worded by both noises: resolved by the windows and the seeds, by one of them, or by neither, with the
    smallest difference each resolves. `paired`: `paired_difference`'s dict or None (not paired); `seeds`:
    `noise_statement`'s dict for the same pair (its `inside_noise` None = one seed)."""
    variant, reference = names
    by_windows = None if paired is None else not (paired["ci95_bpb"][0] <= 0.0 <= paired["ci95_bpb"][1])
    by_seeds = None if seeds.get("inside_noise") is None else not seeds["inside_noise"]
    diff = paired["difference_bpb"] if paired is not None else seeds.get("diff")
    w = (f"the windows resolve differences above {paired['resolves_bpb']:.4f} bpb" if paired is not None
         else "the windows' noise is not measured (not paired)")
    s = (f"the seeds above {seeds['two_se']:.4f} bpb" if by_seeds is not None
         else "the seeds' noise is not measured (one seed, or a value missing)")
    if diff is None:
        return {"resolved_by": None, "text": f"no difference to judge: {w}; {s}"}
    direction = f"{variant} {'ahead of' if diff < 0 else 'behind'} {reference} by {abs(diff):.4f} bpb"
    if by_windows and by_seeds:
        head, resolved = f"resolved by the windows and the seeds: {direction}", "both"
    elif by_windows:
        head = f"resolved by the windows{', not by the seeds' if by_seeds is False else ''}: {direction} on these " \
               "trained models"
        resolved = "windows"
    elif by_seeds:
        head, resolved = f"resolved by the seeds, not by the windows: {direction}", "seeds"
    elif by_windows is None and by_seeds is None:
        head, resolved = f"not judged, neither noise is measured: |difference| {abs(diff):.4f} bpb", None
    else:
        head, resolved = f"resolved by neither: |difference| {abs(diff):.4f} bpb", "neither"
    return {"resolved_by": resolved, "by_windows": by_windows, "by_seeds": by_seeds, "text": f"{head} ({w}; {s})"}
