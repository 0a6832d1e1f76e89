"""Python's garbage collector off the step (issue 67 item 3, nagmoe/train/gc_control.py): automatic collection is
off in the loop, a full collection runs after every K-th step, and a reference cycle made in the loop is still
freed there; K = 0 leaves the collector alone; leaving the loop puts it back and unfreezes."""
import gc
import weakref

import pytest

from nagmoe.config import LEGACY_VALUES
from nagmoe.train.gc_control import LoopGC
from nagmoe.train.trainer import Trainer


class Cycle:
    def __init__(self):
        self.me = self


def planted(freed: list, tag):
    """A reference cycle no one holds: only a collection frees it (then `tag` lands in `freed`)."""
    c = Cycle()
    weakref.finalize(c, freed.append, tag)


@pytest.fixture(autouse=True)
def collector_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def test_a_cycle_made_in_the_loop_is_freed_at_the_next_kth_step_and_not_before():
    freed = []
    with LoopGC(3) as loop:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for step in range(1, 7):
            planted(freed, step)
            for _ in range(20_000):  # enough allocations to trigger an automatic collection, were it on
                Cycle()
            loop.step_done(step)
            assert freed == list(range(1, step // 3 * 3 + 1)), (step, freed)  # freed at steps 3 and 6 only
    assert gc.isenabled() and gc.get_freeze_count() == 0 and loop.collections == 2


def test_zero_leaves_pythons_collector_alone_and_is_the_legacy_value():
    assert LEGACY_VALUES["train.gc_every"] == 0
    with LoopGC(0) as loop:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        loop.step_done(50)
    assert loop.collections == 0


class Planting(Trainer):
    """Plants one cycle per step and records, at each step's start, the collector's state and what was freed."""

    def train_step(self):
        self.seen.append((self.progress.step + 1, gc.isenabled(), list(self.freed)))
        planted(self.freed, self.progress.step + 1)
        return super().train_step()


def test_the_trainer_frees_cycles_every_k_steps_with_automatic_collection_off(micro_config, tmp_path):
    cfg = micro_config("train.max_steps=5", "train.gc_every=2", "train.hang_timeout_s=0")
    trainer = Planting(cfg, str(tmp_path / "run"), quiet=True)
    trainer.seen, trainer.freed = [], []
    trainer.run()
    # collections after steps 2 and 4: at step 3's start steps 1-2 are freed, at step 5's start 1-4
    assert trainer.seen == [(1, False, []), (2, False, []), (3, False, [1, 2]), (4, False, [1, 2]),
                            (5, False, [1, 2, 3, 4])]
    assert gc.isenabled() and gc.get_freeze_count() == 0
