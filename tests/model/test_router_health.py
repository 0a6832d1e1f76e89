"""Router and load telemetry (issue 22): the statistics of known counts, the metrics lines of a real run,
and the analysis section."""
import math
import os

import pytest
import torch

from nagmoe.model.router_health import RouterTelemetry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_statistics_of_known_counts():
    tel = RouterTelemetry()
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [13.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    probs = torch.tensor([0.25, 0.25, 0.25, 0.25])
    entropy = torch.tensor([16 * math.log(4), 0.0], dtype=torch.float64)  # uniform; one-hot
    tel.add_tensors(counts, entropy, torch.tensor([16.0, 16.0], dtype=torch.float64))
    r = tel.report(ep=2)
    assert r["max_over_mean"] == pytest.approx([1.0, 13 / 4])
    assert r["cv"] == pytest.approx([0.0, float(counts[1].std(unbiased=False) / 4)])
    assert r["dead"] == [0, 2] and r["entropy"] == pytest.approx([math.log(4), 0.0])
    assert r["ep_max_over_mean"] == pytest.approx([1.0, 16 / 8])  # EP rank 0 holds experts 0-1
    assert r["load"][1] == pytest.approx([13 / 16, 3 / 16, 0.0, 0.0])
    assert float(torch.special.entr(probs).sum()) == pytest.approx(math.log(4))


def test_a_run_logs_router_health_per_layer(micro_config, tmp_path):
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = str(tmp_path / "run")
    cfg = micro_config("train.max_steps=3", "log.every=2", "train.micro_batch_tokens=128")
    Trainer(cfg, run_dir, quiet=True).run()
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    logged = [r for r in records if "router" in r]
    assert [r["step"] for r in logged] == [2, 3]  # at log steps (and the last)
    n_layers, n_experts = cfg.model.n_layers, cfg.model.moe.n_experts
    for r in logged:
        router = r["router"]
        assert set(router) == {"entropy", "max_over_mean", "cv", "dead", "dropped_frac", "min_over_mean",
                               "max_over_mean_p50", "max_over_mean_p90", "max_over_mean_max"}
        assert router["dropped_frac"] == [0.0] * len(router["dead"])  # dropless by default
        across = {k: router.pop(k) for k in ("max_over_mean_p50", "max_over_mean_p90", "max_over_mean_max")}
        assert across["max_over_mean_max"] == max(router["max_over_mean"])  # scalars across the layers
        assert all(len(v) == n_layers for v in router.values())
        assert all(0 < e <= math.log(n_experts) + 1e-6 for e in router["entropy"])
        assert all(0 <= d <= n_experts for d in router["dead"])
    assert all(r["moe_max_over_mean"] >= 1.0 for r in records)


def test_the_analysis_has_a_router_section():
    from analysis_models import randomize_outputs, tiny_model, token_batches

    from nagmoe.analysis.run_analysis import analyze_model

    model = tiny_model(ffn="moe")
    randomize_outputs(model)
    router = analyze_model(model, token_batches(), dial_rates=())["router"]
    assert len(router["load"]) == 2 and all(sum(row) == pytest.approx(1.0) for row in router["load"])
    assert len(router["max_over_mean"]) == 2 and "ep_max_over_mean" not in router
    dense = analyze_model(tiny_model(ffn="dense"), token_batches(), dial_rates=())["router"]
    assert isinstance(dense, str) and "dense" in dense


def test_load_statistics_across_layers_equal_a_hand_computation():
    """Issue 43 item 3: min/mean per layer, and nearest-rank p50/p90/max of the per-layer max/mean."""
    import torch

    from nagmoe.model.router_health import RouterTelemetry

    counts = torch.tensor([[4, 4, 4, 4], [8, 4, 2, 2], [1, 1, 1, 13], [6, 2, 4, 4], [0, 8, 4, 4]], dtype=torch.float64)
    t = RouterTelemetry()
    t.add_tensors(counts, torch.ones(5), torch.full((5,), 8.0))
    r = t.report()
    means = counts.mean(1)
    assert r["min_over_mean"] == pytest.approx((counts.min(1).values / means).tolist())
    worst = sorted((counts.max(1).values / means).tolist())  # [1.0, 1.5, 2.0, 2.0, 3.25]
    assert (r["max_over_mean_p50"], r["max_over_mean_p90"], r["max_over_mean_max"]) == (worst[2], worst[4], worst[4])
    assert r["min_over_mean"][4] == 0.0 and r["dead"][4] == 1


def test_between_stats_steps_a_line_folds_each_layer_list_to_its_worst_layer(micro_config, tmp_path):
    """log.stats_every (issue 67 item 2): per-layer lists at its multiples and the last step; the lines between
    carry one number per key (the worst layer; dead experts summed), so their size does not grow with depth."""
    import json

    from nagmoe.analysis.report_balance import balance_row
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = str(tmp_path / "run")
    cfg = micro_config("train.max_steps=3", "log.every=1", "log.stats_every=2", "train.hang_timeout_s=0")
    Trainer(cfg, run_dir, quiet=True).run()
    records = {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))}
    full, folded = records[2]["router"], records[1]["router"]
    assert all(isinstance(v, list) for k, v in records[3]["router"].items() if not k.startswith("max_over_mean_"))
    assert set(folded) == set(full) | {"layers"} and folded["layers"] == cfg.model.n_layers
    assert not any(isinstance(v, list) for v in folded.values())
    assert len(json.dumps(records[1])) < 1024
    row = balance_row("run", [records[1]])  # the report's table reads a folded line too
    assert row is not None and "-" not in row[1:6]


def test_folding_takes_the_worst_layer_of_each_list():
    from nagmoe.train.router_accounting import compact

    health = {"entropy": [1.2, 0.4, 0.9], "max_over_mean": [1.1, 2.5, 1.3], "min_over_mean": [0.9, 0.2, 0.5],
              "dead": [0, 2, 1], "max_over_mean_max": 2.5}
    assert compact(health) == {"entropy": 0.4, "max_over_mean": 2.5, "min_over_mean": 0.2, "dead": 3,
                               "max_over_mean_max": 2.5, "layers": 3}
