"""tools/bench/step_profile.py: a profiled training step split by region (issue 60). The regions partition the step's
launches, and each sublayer's backward is found (its forward alone is fewer launches than its region)."""
from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))
sys.path.insert(0, os.path.join(REPO, "tools", "gpu_check"))  # gpu_check_profile

import step_profile  # noqa: E402


def test_grouped_mm_flops_from_the_operand_shapes():
    assert step_profile.grouped_mm_flops([[96, 32], [4, 32, 64], [4]]) == 2 * 96 * 32 * 64  # forward, input grad
    assert step_profile.grouped_mm_flops([[32, 96], [96, 64], [4]]) == 2 * 32 * 96 * 64  # weight grad (E, 32, 64)
    assert step_profile.grouped_mm_flops([[4]]) == 0.0


def test_union_of_kernel_intervals():
    assert step_profile._union_seconds([(0, 2e6), (1e6, 3e6), (5e6, 6e6)]) == pytest.approx(4.0)


def _leaf_launches(events):
    from torch.autograd import DeviceType

    return sum(1 for e in events if e.device_type == DeviceType.CPU and
               (e.name == step_profile.GROUPED_MM or (step_profile._is_leaf_aten(e) and not step_profile._inside_gemm(e))))


def test_regions_partition_the_step_and_find_the_backward(micro_config, tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nagmoe.train.trainer import Trainer

    trainer = Trainer(micro_config("train.batch_tokens=256", "train.micro_batch_tokens=128"), str(tmp_path / "run"),
                      quiet=True)
    try:
        trainer.train_step()
        regions = step_profile.Regions(trainer.model)
        try:
            with step_profile.model_span(trainer.model), profile(activities=[ProfilerActivity.CPU],
                                                                 record_shapes=True) as prof:
                trainer.train_step()
        finally:
            regions.close()
        table = step_profile.region_table(prof.events(), cuda=False)
        # forward only, same batch: each sublayer's forward launches, without a backward
        x, y = trainer._last_batch
        regions = step_profile.Regions(trainer.model)
        try:
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as fwd:
                trainer.model(x, y)
        finally:
            regions.close()
        forward = step_profile.region_table(fwd.events(), cuda=False)["regions"]
    finally:
        trainer.release_lease()
    r = table["regions"]
    assert table["launches"] == _leaf_launches(prof.events())  # every launch in exactly one region
    for name in ("attention", "moe_glue", "moe_gemm", "loss", "optimizer"):
        assert r[name]["launches"] > 0, (name, r)
    # two micro-steps, each a forward and a backward: the region holds more than twice one forward
    for name in ("attention", "moe_glue", "moe_gemm"):
        assert r[name]["launches"] > 2 * forward[name]["launches"] > 0, (name, r[name], forward[name])
    assert r["moe_gemm"]["launches"] == 2 * 3 * 2 * trainer.cfg.model.n_layers  # 2 GEMMs, forward + 2 grads each
    assert step_profile.format_table(table).count("\n") == len(step_profile.REGIONS) + 2


@pytest.mark.parametrize("read_after", [False, True])
def test_the_profile_sections_optimizer_timer_passes_the_guard_on(micro_config, tmp_path, read_after):
    """gpu_check_profile.OptimizerTimer wraps the bundle's step: the device-guarded step (`ok=`, the CUDA default,
    forced here) goes through it, each step is timed once, and closing it leaves the bundle's own method."""
    from gpu_check_profile import OptimizerTimer

    from nagmoe.train.trainer import Trainer

    trainer = Trainer(micro_config("train.batch_tokens=256", "train.micro_batch_tokens=128"), str(tmp_path / "run"),
                      quiet=True)
    trainer.metrics_read_after = read_after
    try:
        timer = OptimizerTimer(trainer)
        try:
            trainer.train_step()
            trainer.train_step()
            times = timer.take()
        finally:
            timer.close()
        assert len(times) == 2 and all(t > 0 for t in times)
        assert "step" not in vars(trainer.optim)  # the class's method again
    finally:
        trainer.release_lease()
