"""tools/bench/bench_eval_sample.py (issue 66): on two copies of one trained run, every sample's paired difference is 0
with a paired standard error of 0, while the unpaired one (the windows' own variation) is not; the old sample is
the split's first windows, the new one the whole split."""
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))

import bench_eval_sample  # noqa: E402


def test_the_same_run_twice_differs_by_nothing_paired_and_by_its_windows_unpaired(trained_run, tmp_path,
                                                                                  monkeypatch):
    shutil.copytree(os.path.join(trained_run, "data"), tmp_path / "data")
    for name in ("a", "b"):
        shutil.copytree(os.path.join(trained_run, "run"), tmp_path / name)
    monkeypatch.chdir(tmp_path)  # the run's config names its data dir relative to the folder
    out = tmp_path / "bench.json"
    assert bench_eval_sample.main(["a", "b", "--pairs", "1:0", "--old-tokens", "256", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["pairs"]
    assert [r["sample"] for r in rows] == ["old (first windows)", "strided, old size", "whole split (new)"]
    assert rows[0]["windows"] == 256 // 64 and rows[2]["windows"] > rows[0]["windows"]
    for r in rows:
        assert r["difference_bpb"] == 0.0 and r["paired_se_bpb"] == 0.0 and r["unpaired_se_bpb"] > 0
