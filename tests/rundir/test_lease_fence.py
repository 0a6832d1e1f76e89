"""Issue 41, acceptance "two trainers on one run dir": a `--take-over` while the first trainer runs stops the
first at its next write (exit 2, one line naming the new holder, no traceback); the run dir holds one consistent
history: metrics steps unique and increasing, every checkpoint verifies, the summary is the second trainer's."""
import json
import os

from nagmoe.checkpoint.files import verify_checkpoint



def published_steps(run_dir):
    names = os.listdir(os.path.join(run_dir, "checkpoints"))
    return sorted(int(n[len("step_"):]) for n in names if n.startswith("step_") and n[len("step_"):].isdigit())


def test_the_first_trainer_stops_with_exit_2_naming_the_new_holder(taken_over_run):
    first, second = taken_over_run["outcome"]["first"], taken_over_run["outcome"]["second"]
    assert first["exit"] == 2, first["stderr"]
    assert "Traceback" not in first["stderr"] and "Traceback" not in second["stderr"]
    errors = [line for line in first["stderr"].splitlines() if ": error: " in line]
    assert len(errors) == 1 and "taken over by" in errors[0] and f"pid {second['pid']}" in errors[0], first["stderr"]
    assert second["exit"] == 0, second["stderr"]


def test_the_run_dir_holds_one_consistent_history(taken_over_run):
    run_dir, outcome = taken_over_run["run_dir"], taken_over_run["outcome"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, outcome["second"]["max_steps"] + 1))  # log.every=1: unique, increasing, whole
    for step in published_steps(run_dir):
        verify_checkpoint(os.path.join(run_dir, "checkpoints", f"step_{step:06d}"))
    assert published_steps(run_dir)[-1] == outcome["second"]["max_steps"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["steps"] == outcome["second"]["max_steps"]
    with open(os.path.join(run_dir, "run_info.json")) as f:
        resumed_from = json.load(f)["resumed_from"]  # the second trainer's start, from the first's checkpoint
    assert resumed_from is not None and int(resumed_from[-6:]) < outcome["second"]["max_steps"]  # it trained
    assert not os.path.exists(os.path.join(run_dir, "lease.json"))  # released by its last holder
    assert not os.path.exists(os.path.join(run_dir, "outcome.json"))
