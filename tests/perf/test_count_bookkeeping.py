"""tools/count_bookkeeping.py (issue 67, item 1): on 2 gloo ranks, a 2-step and a 4-step run of the micro model
(EP=1) give every class and path kind a finite, non-negative marginal count per step, and the known per-step
bookkeeping shows up at its sites: the two `should_stop` all-reduces (trainer.py), the preemption check's
all-reduce and its stat of the request file (preemption.py). A smoke test of the counter, not a bar on the counts."""
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import count_bookkeeping  # noqa: E402

pytestmark = pytest.mark.distributed


def test_the_tool_uses_the_tests_micro_overrides(request):
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    assert count_bookkeeping.MICRO_OVERRIDES == root.MICRO_OVERRIDES


def per_step(sites, match) -> float:
    return sum(s["per_step"] for s in sites if match(s))


def test_counts_every_class_and_finds_the_per_step_sites(micro_data, tmp_path, capsys):
    data_dir, corpus = micro_data
    out = tmp_path / "counts.json"
    assert count_bookkeeping.main(["--ep", "1", "--steps", "2", "4", "--data-dir", data_dir, "--corpus", corpus,
                                   "--work-dir", str(tmp_path / "runs"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["steps"] == [2, 4] and result["log_every"] == 10 and list(result["runs"]) == ["ep1"]
    assert "train.hang_timeout_s=0" in result["overrides"]
    ranks = result["runs"]["ep1"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert set(count_bookkeeping.CLASSES) <= set(r["collectives"])
        assert {*count_bookkeeping.PATH_KINDS, "total"} <= set(r["paths"])
        for value in (*r["collectives"].values(), *r["paths"].values()):
            assert math.isfinite(value) and value >= 0, r
        assert r["collectives"]["ep_exchange"] == 0  # EP=1: no exchange
        book, paths = r["bookkeeping_sites"], r["path_sites"]
        # the loop's condition and the `last` test: one all-reduce each per step, under should_stop
        assert per_step(book, lambda s: "nagmoe/train/trainer.py:" in s["site"] and " should_stop" in s["site"]) == 2
        # the preemption check: its all-reduce and, on every rank, the request file's stat
        assert per_step(book, lambda s: s["site"].startswith("nagmoe/train/preemption.py:")) == 1
        assert per_step(paths, lambda s: s["kind"] == "stat" and s["path"] == "preempt.request"
                        and s["site"].startswith("nagmoe/train/preemption.py:")) == 1
        assert r["collectives"]["bookkeeping"] >= 3 and r["paths"]["total"] >= 1
    for name in (*count_bookkeeping.CLASSES, *count_bookkeeping.PATH_KINDS, "should_stop", "preempt.request"):
        assert name in printed
