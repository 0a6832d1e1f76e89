"""Issue 69, honest accounting through the Trainer: a static-MoD run charges its budget as gather does (the executed
fractions' FLOPs) while its executed FLOPs count what static computes; the summary names the implementation that
ran and what it saved against full depth, and the report shows both."""
import json
import os
from types import SimpleNamespace

import pytest

from nagmoe.flops import executed_flops_per_token, flops_per_token
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.trainer import Trainer

STEPS = 6  # skipping starts after the first step (model.nag.warmup_tokens=256 = one batch)


@pytest.fixture(scope="module")
def runs(micro_data, tmp_path_factory, request):
    root_conftest = request.config.pluginmanager.get_plugin(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py"))
    from nagmoe.config import load_config

    data_dir, corpus = micro_data
    out = {}
    for impl in ("gather", "static"):
        cfg = load_config(os.path.join(root_conftest.REPO, "configs/tiny.yaml"), [
            *root_conftest.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}",
            f"train.max_steps={STEPS}", "model.mod.skip_rate=0.3", f"model.mod.impl={impl}"])
        run_dir = str(tmp_path_factory.mktemp(impl))
        trainer = Trainer(cfg, run_dir, quiet=True)
        out[impl] = SimpleNamespace(cfg=cfg, summary=trainer.run(), dir=run_dir,
                                    records=[r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
                                             if "executed_fractions" in r])
    return out


@pytest.mark.parametrize("impl", ["gather", "static"])
def test_the_budget_is_charged_alike_and_executed_flops_follow_the_impl(runs, impl):
    run = runs[impl]
    m, T, bt = run.cfg.model, run.cfg.data.seq_len, run.cfg.train.batch_tokens
    s = run.summary
    assert len(run.records) == STEPS and any(r["mod_skipping"] for r in run.records)
    # the budget: the executed fractions' FLOPs, whichever implementation ran
    charged = sum(flops_per_token(m, T, r["executed_fractions"]) for r in run.records) * bt
    assert s["flops"] == pytest.approx(charged, rel=1e-9)
    assert s["mod_impl"] == impl and s["mod_impl_steps"] == {impl: STEPS}
    with open(os.path.join(run.dir, "run_info.json")) as f:
        assert json.load(f)["backends"]["MoD.impl"] == impl
    full = flops_per_token(m, T) * bt * STEPS
    assert s["flops_full_depth"] == pytest.approx(full, rel=1e-12)
    assert s["executed_saving"] == pytest.approx(1 - s["flops_executed"] / full, rel=1e-12)
    if impl == "static":  # every step priced as static computes it: no padding, the skipped rows' work charged
        executed = sum(executed_flops_per_token(m, T, r["executed_fractions"], None, impl="static")
                       for r in run.records) * bt
        assert s["flops_executed"] == pytest.approx(executed, rel=1e-9)
        assert s["flops"] < s["flops_executed"] < full
    else:  # gather: at least the charged FLOPs (attention's padded query rows)
        assert s["flops_executed"] >= s["flops"] * (1 - 1e-12)


def test_static_saves_less_than_gather_as_executed(runs):
    """Same data, same thresholds rule: static's saving as executed is below gather's (it computes the skipped
    tokens' attention and router), both above zero."""
    gather, static = runs["gather"].summary, runs["static"].summary
    assert 0 < static["executed_saving"] < gather["executed_saving"]


def test_the_report_names_the_impl_and_its_saving(runs):
    from nagmoe.analysis.report import mod_impl

    run = runs["static"]
    assert mod_impl(SimpleNamespace(summary=run.summary, run_info={})) == "static"
    assert mod_impl(SimpleNamespace(summary={}, run_info={"backends": {"MoD.impl": "gather"}})) == "gather"
    assert mod_impl(SimpleNamespace(summary=None, run_info={})) is None  # no MoD, or an old run
