"""The report's comparisons with paired differences (issue 66), on run dirs in the committed format of 0f909d0
(tests/analysis/fixtures/run-dirs-0f909d0: config.yaml, metrics.jsonl, summary.json and run_info.json of four
micro runs, pre-norm and NAG x seeds 0 and 1, written by that commit's trainer; no checkpoints, so the report
measures nothing and stays fast). Per-window losses are planted with a known difference."""
import json
import math
import os
import shutil

import numpy as np
import pytest

from nagmoe.eval.val_windows import WindowLosses, write_window_losses
from nagmoe.rundir.names import EVAL_WINDOWS_FILE

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "run-dirs-0f909d0")
RUNS = ("baseline-s0", "baseline-s1", "nag-s0", "nag-s1")
LN2 = math.log(2)
N = 300


@pytest.fixture
def runs(tmp_path):
    for name in RUNS:
        shutil.copytree(os.path.join(FIXTURE, name), tmp_path / name)
    return {name: str(tmp_path / name) for name in RUNS}


def report(runs, out):
    from nagmoe.analysis.report import write_report

    return write_report([runs[n] for n in RUNS], str(out), eval_items=0, analysis_tokens=0, log=lambda *_: None)


def plant(run_dir, nats, n_bytes, ids=None, step=3):
    ids = np.arange(N, dtype=np.int64) * 2 if ids is None else ids
    write_window_losses(run_dir, WindowLosses("a" * 16, 64, "strided", 2 * N, ids, nats, n_bytes,
                                              np.full(N, 64, dtype=np.int64), step))


def planted(runs, delta=(-0.01, -0.02)):
    """Baseline seeds s at per-window bpb b_w; NAG seed s at b_w + delta[s] ± 0.01: returns the pooled
    difference measured directly (the difference of the seed means' bpb on the windows)."""
    rng = np.random.default_rng(0)
    n_bytes = rng.integers(150, 260, size=N)
    hard = 1.8 + 0.3 * rng.standard_normal(N)
    diffs = []
    for s in (0, 1):
        ref = hard * LN2 * n_bytes
        var = (hard + delta[s] + 0.01 * rng.standard_normal(N)) * LN2 * n_bytes
        plant(runs[f"baseline-s{s}"], ref, n_bytes)
        plant(runs[f"nag-s{s}"], var, n_bytes)
        diffs.append((var.sum() - ref.sum()) / (LN2 * n_bytes.sum()))
    return sum(diffs) / 2


def set_val_bpb(runs, values):
    for name, value in values.items():
        path = os.path.join(runs[name], "summary.json")
        summary = json.load(open(path))
        summary["val_bpb"] = value
        json.dump(summary, open(path, "w"))


def test_old_run_dirs_render_with_the_not_paired_line(runs, tmp_path):
    data = report(runs, tmp_path / "out")
    (pair,) = data["pairs"]
    assert pair["kind"] == "nag_vs_baseline" and pair["paired"] is None
    assert EVAL_WINDOWS_FILE in pair["not_paired"] and "before per-window losses were kept" in pair["not_paired"]
    assert pair["seeds"]["diff"] is not None  # the seed spread as before
    page = open(data["html"]).read()
    assert "eval windows: not paired: " in page
    assert not any(EVAL_WINDOWS_FILE in p for p in data["problems"])  # an old run dir is no problem


def test_a_planted_difference_is_found_with_its_interval_per_seed_and_pooled(runs, tmp_path):
    measured = planted(runs)
    # the seeds' val bpb spread wide: the windows resolve the difference, the seeds do not
    set_val_bpb(runs, {"baseline-s0": 1.80, "baseline-s1": 1.95, "nag-s0": 1.79, "nag-s1": 1.93})
    data = report(runs, tmp_path / "out")
    (pair,) = data["pairs"]
    paired = pair["paired"]
    assert paired["difference_bpb"] == pytest.approx(measured, rel=1e-12)
    lo, hi = paired["ci95_bpb"]
    assert lo < measured < hi < 0
    assert (paired["windows"], paired["tokens"], paired["method"], paired["seeds"]) == (N, N * 64, "delta", 2)
    assert [p["seed"] for p in pair["per_seed"]] == [0, 1]
    assert pair["verdict"]["text"].startswith("resolved by the windows, not by the seeds: nag ahead of baseline")
    assert pair["claim"]["tokens_to_resolve"] > 0
    page = open(data["html"]).read()
    assert "paired over 300 validation windows (19,200 tokens, pooled over 2 seeds)" in page
    assert f"{measured:+.4f} bpb, 95% interval [{lo:+.4f}, {hi:+.4f}]" in page
    assert "below what 2 seeds resolve" in page  # the seed statement beside it
    assert "figures/paired_differences.png" in page
    theirs = next(row for row in page.split("<tr>") if "NAG loss advantage" in row)  # "Their numbers beside ours"
    claim = ("a difference the size of the paper&#x27;s smallest NAG advantage, 0.012 nats at width/depth 80 would "
             "be resolved by these windows")
    assert claim in theirs


def test_the_pairing_is_refused_when_a_run_scored_other_windows(runs, tmp_path):
    planted(runs)
    rng = np.random.default_rng(3)
    n_bytes = rng.integers(150, 260, size=N)
    for s in (0, 1):  # NAG scored on the odd windows: nothing in common with the baseline's even ones
        plant(runs[f"nag-s{s}"], 1.8 * LN2 * n_bytes, n_bytes, ids=np.arange(N, dtype=np.int64) * 2 + 1)
    (pair,) = report(runs, tmp_path / "out")["pairs"]
    assert pair["paired"] is None and "no common windows" in pair["not_paired"]


def test_a_malformed_or_stale_file_is_one_problem_line_and_the_pair_uses_the_rest(runs, tmp_path):
    planted(runs)
    with open(os.path.join(runs["nag-s1"], EVAL_WINDOWS_FILE), "w") as f:
        f.write('{"format": "nagmoe.eval_windows", "version": 1, "window_ids": [' + "9" * 5000 + "]}")
    data = report(runs, tmp_path / "out")
    lines = [p for p in data["problems"] if EVAL_WINDOWS_FILE in p]
    assert len(lines) == 1 and "nag-s1" in lines[0] and len(lines[0]) < 1200, lines
    (pair,) = data["pairs"]
    assert pair["paired"]["seeds"] == 1 and [p["seed"] for p in pair["per_seed"]] == [0]
    # a file of an earlier step than the run's end pairs stale numbers: left out, with the reason
    plant(runs["nag-s0"], np.ones(N), np.ones(N, dtype=np.int64), step=2)
    (pair,) = report(runs, tmp_path / "out2")["pairs"]
    assert pair["paired"] is None and "of step 2, the run ended at step 3" in pair["not_paired"]
