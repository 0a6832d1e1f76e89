import pytest

from nagmoe.config import TrainConfig
from nagmoe.train.schedule import injection_warmup, lr_multiplier, schedule_progress


def test_step_horizon_key_points():
    cfg = TrainConfig(warmup_steps=10, schedule_steps=100, warmdown_frac=0.5, final_lr_frac=0.1)
    lr = lambda step: lr_multiplier(step, None, cfg)  # noqa: E731
    assert lr(0) == pytest.approx(0.1)  # warm-up start: (0 + 1) / 10
    assert lr(4) == pytest.approx(0.5)
    assert lr(9) == pytest.approx(1.0)  # warm-up end
    assert lr(30) == 1.0  # constant
    assert lr(50) == 1.0  # warm-down start: progress = 1 - warmdown_frac
    assert lr(75) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down
    assert lr(100) == pytest.approx(0.1)  # end = final_lr_frac
    assert lr(250) == pytest.approx(0.1)  # past the horizon (max_steps is only a stop)
    values = [lr(s) for s in range(50, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone warm-down


def test_flop_horizon_ignores_step_count():
    cfg = TrainConfig(warmup_steps=10, schedule_steps=100, warmdown_frac=0.5, final_lr_frac=0.1,
                      flop_budget=1e12)
    # A MoD run takes more (cheaper) steps: the step count is far past schedule_steps, FLOPs decide.
    assert lr_multiplier(0, 0.0, cfg) == pytest.approx(0.1)  # warm-up is always in steps
    assert lr_multiplier(9, 1e9, cfg) == pytest.approx(1.0)
    assert lr_multiplier(400, 0.5e12, cfg) == 1.0  # warm-down start
    assert lr_multiplier(600, 0.75e12, cfg) == pytest.approx(0.55)
    assert lr_multiplier(800, 1e12, cfg) == pytest.approx(0.1)  # end of budget
    assert schedule_progress(800, 0.25e12, cfg) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="flops_done"):
        lr_multiplier(5, None, cfg)


def test_short_run_warmdown_overlapping_warmup_and_edge_cases():
    cfg = TrainConfig(warmup_steps=10, schedule_steps=10, warmdown_frac=1.0, final_lr_frac=0.0)
    assert lr_multiplier(0, None, cfg) == pytest.approx(0.1)  # min(0.1, 1.0)
    assert lr_multiplier(8, None, cfg) == pytest.approx(0.2)  # min(0.9, 1 - 0.8)
    no_warm = TrainConfig(warmup_steps=0, schedule_steps=10, warmdown_frac=0.0, final_lr_frac=0.3)
    assert lr_multiplier(0, None, no_warm) == 1.0
    assert lr_multiplier(9, None, no_warm) == 1.0
    assert lr_multiplier(10, None, no_warm) == pytest.approx(0.3)


def test_injection_warmup():
    assert injection_warmup(0, 1000) == 0.0
    assert injection_warmup(250, 1000) == 0.25
    assert injection_warmup(5000, 1000) == 1.0
    assert injection_warmup(0, 0) == 1.0
