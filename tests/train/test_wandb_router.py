"""wandb receives the router telemetry chartable (issue 43 item 3): each per-layer list of the metrics' router
report becomes one scalar per layer (`router.<name>.layer_<i>`), the report's scalars keep their keys, and the
values are the metrics.jsonl record's. A real offline wandb run; its `log` is wrapped only to see the calls."""
import os

import pytest

from nagmoe.train.wandb_mode import wandb_record

pytest.importorskip("wandb")


def test_the_router_report_reaches_wandb_one_scalar_per_layer(micro_config, tmp_path, monkeypatch):
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = str(tmp_path / "run")
    cfg = micro_config("log.wandb=offline", "log.every=1", "train.max_steps=2", "model.moe.expert_bias=true",
                       "model.moe.bias_update_rate=0.01")
    trainer = Trainer(cfg, run_dir, quiet=True)
    logged, real_log = [], trainer.wandb.log

    def seen(data, *args, **kwargs):
        logged.append(data)
        return real_log(data, *args, **kwargs)

    trainer.wandb.log = seen
    trainer.run()
    records = {r["step"]: r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))}
    assert [d.get("step") for d in logged] == [1, 2]
    for data in logged:
        router, want = data["router"], records[data["step"]]["router"]
        assert set(router) == set(want)
        for name, value in want.items():
            if isinstance(value, list):
                assert router[name] == {f"layer_{i}": v for i, v in enumerate(value)}, name
            else:
                assert router[name] == value and isinstance(value, (int, float)), name
        assert "rerouted_frac" in router and set(router["bias_range"]) == {"layer_0", "layer_1"}


def test_the_record_leaves_out_none_and_keeps_every_other_field():
    rec = {"step": 3, "loss": 2.5, "val_bpb": None, "router": {"entropy": [1.0, 2.0], "receive_peak_rows": 7.0}}
    assert wandb_record(rec) == {"step": 3, "loss": 2.5,
                                 "router": {"entropy": {"layer_0": 1.0, "layer_1": 2.0}, "receive_peak_rows": 7.0}}
    assert wandb_record({"step": 1}) == {"step": 1}


def test_wandb_is_written_at_the_metrics_lines_steps_only(micro_config, tmp_path, monkeypatch):
    """Issue 67 item 2: W&B at log.every steps (and eval and last steps), as metrics.jsonl, not every step."""
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = str(tmp_path / "run")
    cfg = micro_config("log.wandb=offline", "log.every=2", "train.max_steps=5", "train.hang_timeout_s=0")
    trainer = Trainer(cfg, run_dir, quiet=True)
    steps, real_log = [], trainer.wandb.log
    trainer.wandb.log = lambda data, *a, **kw: (steps.append(data["step"]), real_log(data, *a, **kw))
    trainer.run()
    assert steps == [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))] == [2, 4, 5]
