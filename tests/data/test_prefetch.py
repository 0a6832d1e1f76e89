"""Batches prefetched (issue 67 item 4, nagmoe/data/prefetch.py): the same batches in the same order, the position
consumed saved (not the one read ahead), the thread's errors raised on the main thread, no thread left behind."""
import gc
import os
import shutil
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from nagmoe.base.errors import UserError
from nagmoe.data.loader import TokenLoader
from nagmoe.data.prefetch import PrefetchLoader

T, B, SEED = 64, 32, 3


def bare(data_dir, **kw):
    return TokenLoader(data_dir, "train", T, B, SEED, **kw)


def same(a, b):
    return all(u.dtype == v.dtype == torch.int64 and torch.equal(u, v) for u, v in zip(a, b))


OLDER: set = set()  # prefetch threads alive before the test (another test's trainer, still held): not its own


@pytest.fixture(autouse=True)
def older_threads():
    OLDER.clear()
    OLDER.update(t.ident for t in threading.enumerate() if t.name == "nagmoe-prefetch")


def live_prefetch_threads():
    """The prefetch threads this test started that are still alive (after a bounded wait)."""
    gc.collect()  # a dropped PrefetchLoader's finalizer stops its thread
    deadline = time.monotonic() + 5
    while True:
        alive = [t for t in threading.enumerate() if t.name == "nagmoe-prefetch" and t.ident not in OLDER]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def read_ahead(pf):
    """Batches the wrapped loader has handed out so far (the consumed ones and those read ahead)."""
    inner = pf.loader
    return inner.epoch * inner.batches_per_epoch + inner.batch_in_epoch


def wait_ahead(pf, n):
    deadline = time.monotonic() + 10
    while read_ahead(pf) < n:
        assert time.monotonic() < deadline, (read_ahead(pf), n)
        time.sleep(0.001)
    time.sleep(0.02)
    assert read_ahead(pf) == n  # bounded: depth batches ahead, no more


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_the_same_batches_in_the_same_order_over_more_than_an_epoch(micro_data, depth):
    ref = bare(micro_data[0])
    pf = PrefetchLoader(bare(micro_data[0]), depth=depth)
    n = 2 * ref.batches_per_epoch + 3
    for k in range(n):
        assert same(next(pf), next(ref)), k
    assert ref.epoch == 2 and pf.state_dict() == ref.state_dict()
    pf.close()
    pf.close()  # idempotent
    assert not live_prefetch_threads()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_the_state_is_the_batches_consumed_and_a_resume_continues_bitwise(micro_data, depth):
    data_dir = micro_data[0]
    ref = bare(data_dir)
    per_epoch = ref.batches_per_epoch
    pf = PrefetchLoader(bare(data_dir), depth=depth)
    consumed = 0
    for k in (1, 5, per_epoch - depth - 4, per_epoch, per_epoch + depth + 5):  # k = the epoch exactly, past it
        while consumed < k:
            assert same(next(pf), next(ref))
            consumed += 1
        wait_ahead(pf, consumed + depth)  # the thread is `depth` batches ahead of the step
        state = pf.state_dict()
        assert state == ref.state_dict()
        expected = next(bare_at(data_dir, state))  # a bare loader from the state
        again = PrefetchLoader(bare(data_dir), depth=depth)  # a new loader from the state: batch k+1 next
        again.load_state_dict(state)
        follow = [next(ref) for _ in range(depth + 2)]
        consumed += depth + 2
        assert same(expected, follow[0])
        for want in follow:
            assert same(next(again), want)
            assert same(next(pf), want)  # and the loader asked for its state goes on undisturbed
        again.close()
    # load_state_dict on a running prefetcher: the thread's read-ahead is dropped, the rewind is exact
    wait_ahead(pf, consumed + depth)
    back = ref.state_dict()
    tail = [next(ref) for _ in range(3)]
    skipped = [next(pf) for _ in range(3)]
    assert all(same(a, b) for a, b in zip(skipped, tail))
    pf.load_state_dict(back)
    assert pf.state_dict() == back
    for want in tail:
        assert same(next(pf), want)
    pf.close()
    assert pf.state_dict() == ref.state_dict()  # closed: the wrapped loader rewound to the position consumed
    assert same(next(pf), next(ref))  # and a next() starts a thread again there
    pf.close()
    assert not live_prefetch_threads()


def bare_at(data_dir, state):
    loader = bare(data_dir)
    loader.load_state_dict(state)
    return loader


def test_depth_0_is_the_loader_in_place(micro_data):
    ref, pf = bare(micro_data[0]), PrefetchLoader(bare(micro_data[0]), depth=0)
    for _ in range(3):
        assert same(next(pf), next(ref))
        assert pf.state_dict() == ref.state_dict() == pf.loader.state_dict()
    assert not live_prefetch_threads()
    with pytest.raises(UserError, match="data.prefetch"):
        PrefetchLoader(ref, depth=-1)


def plant_bad_id(data_dir, batch):
    """A copy's train split with id 600 (vocab 512) in one window of epoch 0's batch `batch`, sha256 untouched:
    opened with verify=False (sizes only), only gather's check sees it."""
    probe = bare(data_dir, verify=False)
    window = int(probe._permutation(0)[batch * B + 3])
    shard = int(np.searchsorted(probe._offsets, window, side="right") - 1)
    path = os.path.join(data_dir, probe.data.records[shard]["file"])
    ids = np.memmap(path, dtype=probe.data.arrays[shard].dtype, mode="r+")
    ids[(window - int(probe._offsets[shard])) * T + 7] = 600
    ids.flush()
    del ids
    return path


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_an_error_in_the_thread_is_raised_at_its_batch_on_the_main_thread(micro_data, tmp_path, depth):
    data_dir = str(tmp_path / "data")
    shutil.copytree(micro_data[0], data_dir)
    bad_batch = 6
    path = plant_bad_id(data_dir, bad_batch)
    ref, pf = bare(data_dir, verify=False), PrefetchLoader(bare(data_dir, verify=False), depth=depth)
    for k in range(bad_batch):
        assert same(next(pf), next(ref)), k
    consumed = ref.state_dict()
    with pytest.raises(UserError) as want:
        next(ref)
    with pytest.raises(UserError) as got:
        next(pf)
    assert type(got.value) is UserError and str(got.value) == str(want.value)
    assert len(str(got.value).splitlines()) == 1 and path in str(got.value) and "token id 600" in str(got.value)
    assert threading.current_thread() is threading.main_thread()  # raised here, on the main thread
    assert not live_prefetch_threads()  # the thread ended with its error
    with pytest.raises(UserError) as again:
        next(pf)  # and stays raised, the same object, until a load_state_dict
    assert again.value is got.value
    assert pf.state_dict() == consumed  # the failed batch was not consumed
    pf.close()


def test_anything_else_raised_in_the_thread_is_raised_the_same(micro_data):
    class Broken:
        def __init__(self):
            self.loader = bare(micro_data[0])

        def __next__(self):
            if self.loader.batch_in_epoch == 2:
                raise KeyError("planted")
            return next(self.loader)

        def state_dict(self):
            return self.loader.state_dict()

        def load_state_dict(self, state):
            self.loader.load_state_dict(state)

    pf = PrefetchLoader(Broken(), depth=4)
    next(pf), next(pf)
    with pytest.raises(KeyError, match="planted"):
        next(pf)
    assert not live_prefetch_threads()


def test_a_dropped_prefetcher_leaves_no_thread(micro_data):
    pf = PrefetchLoader(bare(micro_data[0]), depth=2)
    next(pf)
    del pf  # never closed (a Trainer built and stepped without run()): its finalizer stops the thread
    assert not live_prefetch_threads()


def test_pinned_in_the_thread_on_the_ranks_device(micro_data, monkeypatch):
    """pin (CUDA): the thread makes the rank's device its current one before pinning (a thread starts on cuda:0,
    whose context every rank would otherwise create). CUDA stood in for: the calls are recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("device", d, threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda t: calls.append(("pin", threading.current_thread().name)) or t.clone())
    for device, index in (("cuda:3", 3), (torch.device("cuda"), 5)):
        calls.clear()
        ref, pf = bare(micro_data[0]), PrefetchLoader(bare(micro_data[0]), depth=2, pin=True, device=device)
        for _ in range(3):
            assert same(next(pf), next(ref))
        pf.close()
        assert calls[0] == ("device", index, "nagmoe-prefetch")
        assert calls.count(("pin", "nagmoe-prefetch")) >= 6 and len({c[-1] for c in calls}) == 1


# ----------------------------------------------------------------------------------------------------------
# In the trainer
# ----------------------------------------------------------------------------------------------------------
def losses(run_dir):
    from nagmoe.rundir.metrics import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]


def test_the_trainer_with_and_without_prefetch_and_across_an_interruption(micro_config, tmp_path, monkeypatch):
    """A run with data.prefetch=2 that fails after step 6 (the thread ahead of the step) trains bitwise as one with
    prefetch=0, and resumed from its step-4 checkpoint (with prefetch=4: the key may change) ends as it; no
    prefetch thread is left by any run."""
    from nagmoe.train.trainer import Trainer

    base = ["train.max_steps=8", "train.schedule_steps=8", "train.micro_batch_tokens=128",  # 2 micro-steps
            "train.hang_timeout_s=0", "train.checkpoint_every=4"]

    def train(run_dir, *overrides):
        trainer = Trainer(micro_config(*base, *overrides), str(tmp_path / run_dir), quiet=True)
        try:
            return trainer.run()
        finally:
            assert not live_prefetch_threads()

    train("off", "data.prefetch=0")
    off = losses(tmp_path / "off")
    assert len(off) == 8
    monkeypatch.setenv("NAGMOE_TEST_HOOKS", "1")
    monkeypatch.setenv("NAGMOE_TEST_FAIL_AT_STEP", "6")
    with pytest.raises(UserError, match="after step 6"):
        train("on", "data.prefetch=2")
    # the hook raises after step 6: step 5's line was still buffered (written at sync steps and before each
    # checkpoint, nagmoe/train/loop_log.py), lost with the crash as a resume would truncate it anyway
    assert losses(tmp_path / "on") == off[:4]
    monkeypatch.delenv("NAGMOE_TEST_FAIL_AT_STEP")
    train("on", "data.prefetch=4")
    assert losses(tmp_path / "on") == off


def test_a_bad_id_in_a_trainers_batch_is_its_one_line_user_error(micro_config, micro_data, tmp_path):
    from nagmoe.train.trainer import Trainer

    data_dir = str(tmp_path / "data")
    shutil.copytree(micro_data[0], data_dir)
    path = plant_bad_id(data_dir, 0)  # in the trainer's batches too: every window of the split, one by one
    probe = bare(data_dir, verify=False)
    ids = np.memmap(path, dtype=probe.data.arrays[0].dtype, mode="r+")
    ids[::T] = 600
    ids.flush()
    del ids, probe
    trainer = Trainer(micro_config(f"data.data_dir={data_dir}", "data.verify_shards=false", "data.prefetch=2",
                                   "train.hang_timeout_s=0"), str(tmp_path / "run"), quiet=True)
    with pytest.raises(UserError, match="token id 600 >= vocab_size 512") as e:
        trainer.run()
    assert len(str(e.value).splitlines()) == 1 and path in str(e.value)
    assert "_fill" in [f.name for f in traceback.extract_tb(e.value.__traceback__)]  # read by the thread
    assert not live_prefetch_threads()
