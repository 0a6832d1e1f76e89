"""tools/bench/count_bookkeeping.py (issue 67, item 1): on 2 gloo ranks, a 2-step and a 4-step run of the micro model
(EP=1) give every class and path kind a finite, non-negative marginal count per step, and the known per-step
bookkeeping shows up at its sites: the two `should_stop` all-reduces (trainer.py), the preemption check's
all-reduce and its stat of the request file (preemption.py). A smoke test of the counter, not a bar on the counts."""
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))

import count_bookkeeping  # noqa: E402

pytestmark = pytest.mark.distributed


def test_the_tool_uses_the_tests_micro_overrides(request):
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    assert count_bookkeeping.MICRO_OVERRIDES == root.MICRO_OVERRIDES


def per_step(sites, match) -> float:
    return sum(s["per_step"] for s in sites if match(s))


def run_counts(micro_data, tmp_path, ep: str, steps=("2", "4"), extra=()) -> dict:
    data_dir, corpus = micro_data
    out = tmp_path / f"counts-{ep}.json"
    assert count_bookkeeping.main(["--ep", ep, "--steps", *steps, "--data-dir", data_dir, "--corpus", corpus,
                                   "--work-dir", str(tmp_path / f"runs-{ep}"), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_counts_every_class_and_finds_the_per_step_sites(micro_data, tmp_path, capsys):
    """The legacy cadence (train.sync_every=1, a run dir from before issue 67): one exchange a step, and in it
    rank 0's stat of the request file and read of the lease, at their sites."""
    result = run_counts(micro_data, tmp_path, "1", extra=["train.sync_every=1"])
    printed = capsys.readouterr().out
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
        # the one exchange of each step, and nothing else between steps
        assert per_step(book, lambda s: s["site"].startswith("nagmoe/train/step_decisions.py:")) == 1
        assert r["collectives"]["bookkeeping"] == 1
        request = per_step(paths, lambda s: s["kind"] == "stat" and s["path"] == "preempt.request")
        lease = per_step(paths, lambda s: s["kind"] == "open" and s["path"] == "lease.json")
        assert (request, lease, r["paths"]["total"]) == ((1, 1, 2) if r["rank"] == 0 else (0, 0, 0))
    for name in (*count_bookkeeping.CLASSES, *count_bookkeeping.PATH_KINDS, "step_decisions", "preempt.request"):
        assert name in printed


@pytest.mark.parametrize("ep", ["1", "2"])
def test_bookkeeping_between_steps_is_at_most_one_in_five_steps(micro_data, tmp_path, ep):
    """Issue 67's acceptance: 2 gloo ranks, log.every=10, the marginal count per step between a 10- and a 40-step
    run: <= 0.2 bookkeeping collectives and <= 0.2 run-dir path calls per step and rank (the defaults: one
    exchange per 10 steps, rank 0's stat and lease read every train.sync_every = 10)."""
    result = run_counts(micro_data, tmp_path, ep, steps=("10", "40"))
    for r in result["runs"][f"ep{ep}"]["ranks"]:
        assert r["collectives"]["bookkeeping"] <= 0.2, (r["rank"], r["bookkeeping_sites"])
        assert r["paths"]["total"] <= 0.2, (r["rank"], r["path_sites"])
