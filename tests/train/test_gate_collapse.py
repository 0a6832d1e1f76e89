"""Gate-collapse alarm (issue 16, item 2): gates forced shut after the injection warm-up raise a console
warning and metrics fields, and stop the run (exit 4, checkpoint written) when asked; healthy gates do not."""
import json
import os

import pytest

from nagmoe.checkpoint import list_checkpoints
from nagmoe.train.guards import COLLAPSED_GAIN, EXIT_GATE_COLLAPSE, TrainingHalted, collapsed_fraction

# warm-up of one step (256 tokens): steps 1 runs with warm-up factor 0, the check starts at step 2
CHECK = ("model.nag.warmup_tokens=256", "train.gate_collapse_every=1", "train.max_steps=3")


def shut_gates(trainer, which=None):
    for k, gate in enumerate(trainer.model.stream.gates):
        if which is None or k in which:
            gate.bias.data.fill_(-40.0)  # sigmoid(-40) ~ 4e-18: the modulator sits at its floor


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_collapsed_fraction_threshold():
    assert collapsed_fraction([0.0, 0.2, COLLAPSED_GAIN, 0.01]) == 0.5


def test_healthy_gates_raise_no_alarm(make_trainer, tmp_path, capfd):
    run_dir = str(tmp_path / "healthy")
    make_trainer(*CHECK, run_dir=run_dir).run()
    recs = records(run_dir)
    assert "gate_collapsed_fraction" not in recs[0]  # still in the injection warm-up
    assert [r["gate_collapsed_fraction"] for r in recs[1:]] == [0.0, 0.0]
    assert not any(r.get("gate_collapse_alarm") for r in recs)
    assert "gate collapse" not in capfd.readouterr().err


def test_shut_gates_warn_in_console_and_metrics(make_trainer, tmp_path, capfd):
    run_dir = str(tmp_path / "shut")
    trainer = make_trainer(*CHECK, run_dir=run_dir)
    shut_gates(trainer)
    summary = trainer.run()  # warns, keeps training
    assert summary["steps"] == 3
    recs = records(run_dir)
    assert [r.get("gate_collapse_alarm", False) for r in recs] == [False, True, True]
    assert recs[1]["gate_collapsed_fraction"] == 1.0
    err = capfd.readouterr().err
    assert err.count("[nagmoe] warning: gate collapse at step") == 2
    assert "4/4 NAG sublayers" in err


def test_fraction_is_configurable(make_trainer, tmp_path):
    run_dir = str(tmp_path / "half")
    trainer = make_trainer(*CHECK, "train.gate_collapse_fraction=0.5", run_dir=run_dir)
    shut_gates(trainer, which={0, 1})  # exactly half shut: not *more* than the fraction
    trainer.run()
    recs = records(run_dir)
    assert recs[1]["gate_collapsed_fraction"] == 0.5
    assert not any(r.get("gate_collapse_alarm") for r in recs)


def test_alarm_can_stop_the_run(make_trainer, tmp_path):
    run_dir = str(tmp_path / "stop")
    trainer = make_trainer(*CHECK, "train.gate_collapse_stop=true", run_dir=run_dir)
    shut_gates(trainer)
    with pytest.raises(TrainingHalted) as halted:
        trainer.run()
    assert halted.value.code == EXIT_GATE_COLLAPSE == 4
    assert [step for step, _ in list_checkpoints(run_dir)] == [2]  # inspectable state at the alarm
    assert records(run_dir)[-1]["gate_collapse_alarm"] is True
