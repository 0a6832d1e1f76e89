"""Issue 27, the preflight: on 2 real gloo ranks (parallel.ep=2), `run_preflight` trains, saves, resumes in a
fresh Trainer, probes the all-reduce and all-to-all, and writes a summary whose verdict passes when the layout
fits and names the layout as not fitting when the GPU memory given is too small. The Slurm test
(tests/slurm/test_slurm_jobs.py) runs the same through `nagmoe launch slurm --preflight --submit`. Issue 67: a
MoD config's preflight skips from its first step (start and injection warm-up pinned) and times the same model at
full depth beside it."""
import json
import os

import pytest

from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.distributed


def preflight_on_rank(directory, gpu_memory_gb):
    from nagmoe.train.preflight import format_verdict, run_preflight

    summary = run_preflight(directory, steps=2, gpu_memory_gb=gpu_memory_gb)
    return None if summary is None else (summary, format_verdict(summary))


def write_config(micro_config, directory, *overrides):
    from nagmoe.config import dump_yaml

    os.makedirs(os.path.join(directory, "slurm"))
    with open(os.path.join(directory, "slurm", "config.yaml"), "w") as f:
        f.write(dump_yaml(micro_config("parallel.ep=2", "train.micro_batch_tokens=64", *overrides)))


def test_a_preflight_on_two_ranks_passes_and_names_a_layout_that_cannot_fit(micro_config, tmp_path):
    directory = str(tmp_path / "preflight")
    write_config(micro_config, directory)
    summary, verdict = run_on_ranks(preflight_on_rank, 2, directory, 80.0, timeout=240)[0]
    assert summary["verdict"] == "PASS", verdict
    assert summary["resume"] == {**summary["resume"], "saved_step": 2, "resumed_from": 2, "ended_at": 3}
    assert len(summary["steps"]) == 2 and all(v > 0 for v in summary["bandwidth_gb_s"].values())
    assert len(summary["memory"]["peak_per_rank"]) == 2
    assert summary["mod"] is None and summary["full_depth"] is None  # no MoD: nothing to set beside full depth
    with open(os.path.join(directory, "summary.json")) as f:
        assert json.load(f)["verdict"] == "PASS"
    assert verdict.startswith("nagmoe preflight: PASS — 2 rank(s), ep 2")

    summary, verdict = run_on_ranks(preflight_on_rank, 2, directory, 0.001, timeout=240)[0]  # a 1 MB GPU
    assert summary["verdict"] == "FAIL"
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["memory fits"]
    assert "FAIL  memory fits" in verdict and "the layout does not fit" in verdict
    assert "train.micro_batch_tokens" in verdict
    assert summary["resume"]["resumed_from"] == 2  # the second preflight started from nothing again


def test_a_mod_preflight_skips_from_its_first_step_and_times_full_depth_beside_it(micro_config, tmp_path):
    """Skipping would start after 1M tokens (the micro run's steps are 256 each), so a preflight that left the
    start alone would measure full depth only; on 2 ranks, the histograms of the priming forward are summed."""
    directory = str(tmp_path / "preflight")
    write_config(micro_config, directory, "model.mod.skip_rate=0.2", "model.mod.start_tokens=1000000")
    summary, verdict = run_on_ranks(preflight_on_rank, 2, directory, None, timeout=240)[0]
    assert summary["verdict"] == "PASS", verdict
    mod, full = summary["mod"], summary["full_depth"]
    assert summary["steps"][0]["skip_rate"] > 0  # from the first step
    assert mod["realised_skip"] > 0 and mod["target_skip"] == 0.2
    assert mod["pinned"] == {"model.mod.start_tokens": 1000000, "model.nag.warmup_tokens": 256}
    assert mod["step_s"] > 0 and full["step_s"] > 0 and mod["measured_steps"] == full["measured_steps"] == 3
    assert "PASS  MoD skips" in verdict and "pinned to 0" in verdict
    assert "info  MoD at skip" in verdict and "info  full depth, the same model" in verdict
    assert summary["resume"] == {**summary["resume"], "saved_step": 2, "resumed_from": 2, "ended_at": 3}
