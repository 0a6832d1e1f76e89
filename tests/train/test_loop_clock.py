"""The loop's own time on every metrics line (issue 67 item 6, nagmoe/train/loop_clock.py): step_s is the whole
iteration, data_wait_s the step's wait for batches, loop_s the iteration minus the step's compute; tokens_per_s
over step_s. Latencies are injected with sleeps, so each bound holds on any machine (a sleep lasts at least its
time)."""
import time

from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.loop_clock import LoopClock
from nagmoe.train.trainer import Trainer

DATA_SLEEP, LOOP_SLEEP = 0.03, 0.05


def test_a_line_averages_the_iterations_since_the_last_one():
    now = [10.0]
    clock = LoopClock(clock=lambda: now[0])
    clock.step_done(0.5, 0.1)
    clock.step_done(0.5, 0.1)
    now[0] = 11.4  # two iterations of 0.7 s, each 0.4 s of compute
    line = clock.line()
    assert abs(line["step_s"] - 0.7) < 1e-12 and abs(line["data_wait_s"] - 0.1) < 1e-12
    assert abs(line["loop_s"] - 0.3) < 1e-12
    now[0] = 12.0
    clock.step_done(0.5, 0.0)  # the next line counts from the previous one
    assert abs(clock.line()["step_s"] - 0.6) < 1e-12


class Slowed(Trainer):
    """A loader that takes DATA_SLEEP a batch, and LOOP_SLEEP of bookkeeping outside the step every iteration."""

    def _gate_check(self, rec):
        time.sleep(LOOP_SLEEP)
        return super()._gate_check(rec)


def test_each_line_carries_the_wait_the_loop_and_the_whole_iterations_throughput(micro_config, tmp_path):
    cfg = micro_config("train.max_steps=3", "train.hang_timeout_s=0", "train.micro_batch_tokens=128")
    trainer = Slowed(cfg, str(tmp_path / "run"), quiet=True)
    read = trainer.loader.__class__.__next__

    class SlowLoader(trainer.loader.__class__):
        def __next__(self):
            time.sleep(DATA_SLEEP)
            return read(self)

    trainer.loader.__class__ = SlowLoader
    trainer.run()
    lines = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3]
    for r in lines:  # 2 micro-steps a step (256 tokens in micro-batches of 128)
        # the iteration holds the step (its data wait inside) and the sleep outside it: loop_s = iteration -
        # (step - data wait) >= sleep + data wait, exactly (one monotonic clock)
        assert r["data_wait_s"] >= 2 * DATA_SLEEP
        assert r["loop_s"] >= LOOP_SLEEP + r["data_wait_s"]
        assert r["step_s"] >= r["loop_s"]
        assert abs(r["tokens_per_s"] - cfg.train.batch_tokens / r["step_s"]) <= 1e-9 * r["tokens_per_s"]
