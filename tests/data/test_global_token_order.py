"""Issue 24, same tokens for every run: the training token order depends on the data, the seed and the
rows of one optimizer step (train.batch_tokens // seq_len) only, not on the world size, the micro-batch or
the gradient accumulation; ranks take slices of the same global batch, also across epoch ends. A loader
state from before (no "step_rows") keeps the legacy epoch length."""
import json
import os

import numpy as np
import pytest
import torch

from nagmoe.data.loader import TokenLoader
from nagmoe.data.shards import read_index
from nagmoe.base.errors import UserError

T = 64
SEED = 5
S = 600  # rows per optimizer step: W = 3513 windows of the micro data -> 5 steps an epoch, 513 skipped
LAYOUTS = [(1, 600, 1), (2, 300, 1), (3, 100, 2), (1, 150, 4), (2, 100, 3)]  # (ranks R, rows B, accum A)
STEPS = 12  # 2.4 epochs


def stored_windows(data_dir):
    """(W, T + 1) every training window, numbered shard by shard, straight from the shard files."""
    out = []
    for r in read_index(data_dir)["shards"]:
        if r["split"] == "train":
            ids = np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"]).astype(np.int64)
            out += [ids[k * T:k * T + T + 1] for k in range((len(ids) - 1) // T)]
    return np.stack(out)


def reference_steps(windows, n_steps, step_rows=S, seed=SEED):
    """The global order by its definition: epoch e is default_rng([seed, e]).permutation(W) cut into
    W // step_rows steps; the tail skipped. Nothing here knows of ranks or micro-batches."""
    W, steps, e = len(windows), [], 0
    while len(steps) < n_steps:
        perm = np.random.default_rng([seed, e]).permutation(W)
        steps += [windows[perm[k * step_rows:(k + 1) * step_rows]] for k in range(W // step_rows)]
        e += 1
    return steps[:n_steps]


def as_rows(x, y):
    return torch.cat([x, y[:, -1:]], dim=1).numpy()


def layout_steps(data_dir, R, B, A, n_steps, step_rows=S):
    """Per optimizer step: the rows of its A micro-steps, each the concatenation of ranks 0..R-1."""
    ranks = [TokenLoader(data_dir, "train", T, B, SEED, rank=r, world_size=R, step_rows=step_rows)
             for r in range(R)]
    steps = [np.concatenate([as_rows(*next(ranks[r])) for _ in range(A) for r in range(R)])
             for _ in range(n_steps)]
    return steps, ranks[0].state_dict()


def test_every_layout_sees_the_same_tokens_per_step_across_epochs(micro_data):
    data_dir = micro_data[0]
    windows = stored_windows(data_dir)
    W = len(windows)
    assert STEPS > W // S and W % S  # more than one epoch, with a skipped tail ...
    for R, B, A in LAYOUTS:  # ... which the old per-micro-batch tail (W mod R·B) got wrong under accumulation
        assert (W // (R * B) != (W // S) * A) == (A > 1), (R, B, A)
    expected = reference_steps(windows, STEPS)
    states = []
    for R, B, A in LAYOUTS:
        assert R * B * A == S
        steps, state = layout_steps(data_dir, R, B, A, STEPS)
        for k, (got, want) in enumerate(zip(steps, expected)):
            # the strongest statement: micro-step-major, rank-minor concatenation == the global step, in order
            assert np.array_equal(got, want), f"layout R={R} B={B} A={A}: step {k} differs"
        states.append(state)
    assert all(s == states[0] for s in states)  # the same position (epoch, windows consumed) at the end
    assert states[0]["epoch"] == 2 and states[0]["step_rows"] == S


def test_step_rows_must_be_whole_global_batches(micro_data):
    with pytest.raises(UserError, match="not a multiple of the global batch"):
        TokenLoader(micro_data[0], "train", T, 100, SEED, rank=0, world_size=2, step_rows=300)
    with pytest.raises(UserError, match="fewer than one global batch"):
        TokenLoader(micro_data[0], "train", T, 100, SEED, step_rows=100_000)
    assert TokenLoader(micro_data[0], "train", T, 100, SEED, world_size=2).step_rows == 200  # default R·B


def test_resume_on_another_layout_inside_an_epoch_continues_the_global_order(micro_data):
    data_dir = micro_data[0]
    expected = reference_steps(stored_windows(data_dir), 8)
    _, state = layout_steps(data_dir, 1, 150, 4, 3)  # 3 steps on one rank with 4 micro-steps
    state = json.loads(json.dumps(state))
    ranks = [TokenLoader(data_dir, "train", T, 100, SEED, rank=r, world_size=3, step_rows=S) for r in range(3)]
    for loader in ranks:  # ... resumed on 3 ranks with 2 micro-steps
        loader.load_state_dict(state)
    for k in range(3, 8):  # across the epoch end after step 5
        got = np.concatenate([as_rows(*next(loader)) for _ in range(2) for loader in ranks])
        assert np.array_equal(got, expected[k]), k


def test_a_legacy_state_keeps_the_old_epoch_length(micro_data):
    """A checkpoint from before issue 24 has no "step_rows": the epoch stays W // (R·B) micro-batches (tail
    W mod R·B), through that resume and every later one, so an old run continues exactly as before."""
    data_dir = micro_data[0]
    windows = stored_windows(data_dir)
    W, B = len(windows), 150
    new = TokenLoader(data_dir, "train", T, B, SEED, step_rows=S)
    assert new.batches_per_epoch == (W // S) * (S // B) == 20
    for _ in range(5):
        next(new)
    legacy_state = {k: v for k, v in new.state_dict().items() if k != "step_rows"}  # what the old code saved

    old = TokenLoader(data_dir, "train", T, B, SEED, step_rows=S)
    old.load_state_dict(legacy_state)
    assert old.step_rows is None and old.batches_per_epoch == W // B == 23  # the old epoch length
    # the old order: epoch e is perm_e cut into W // B batches of B (tail W mod B skipped)
    legacy = [windows[np.random.default_rng([SEED, e]).permutation(W)[k * B:(k + 1) * B]]
              for e in range(2) for k in range(W // B)]
    got = [as_rows(*next(old)) for _ in range(25)]  # batches 5..29: into epoch 1
    assert all(np.array_equal(g, w) for g, w in zip(got, legacy[5:30]))
    assert old.epoch == 1
    resaved = old.state_dict()
    assert "step_rows" not in resaved  # it stays legacy at the next resume too
    again = TokenLoader(data_dir, "train", T, B, SEED, step_rows=S)
    again.load_state_dict(json.loads(json.dumps(resaved)))
    assert again.batches_per_epoch == 23
    assert np.array_equal(as_rows(*next(again)), legacy[30])

    # and the new state (with "step_rows") resumes with the new epoch length
    fresh = TokenLoader(data_dir, "train", T, B, SEED, step_rows=S)
    fresh.load_state_dict(new.state_dict())
    assert fresh.step_rows == S and fresh.batches_per_epoch == 20


class Recorder:
    """Stands in for the trainer's loader: records every micro-batch it hands over."""

    def __init__(self, loader):
        self.loader, self.batches = loader, []

    def __iter__(self):
        return self

    def __next__(self):
        x, y = next(self.loader)
        self.batches.append(as_rows(x, y))
        return x, y

    def __getattr__(self, name):
        return getattr(self.loader, name)


def test_the_trainer_sees_the_same_tokens_with_and_without_accumulation(micro_config, micro_data, tmp_path):
    """Two trainers on the micro config, accumulation 1 and 2 (train.micro_batch_tokens), started at the
    last optimizer step of epoch 0: the same tokens in every step, across the epoch end."""
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)
    W = len(stored_windows(micro_data[0]))
    # a step of `rows` rows whose half does not divide the tail: the old epoch (tail per micro-batch) differed
    rows = next(r for r in range(4, 64, 2) if W % r >= r // 2)
    assert W // (rows // 2) != 2 * (W // rows)
    last = W // rows - 1  # the last step of epoch 0
    seen, states = [], []
    for micro in (None, rows // 2 * T):
        overrides = [f"train.batch_tokens={rows * T}", "train.max_steps=3", "train.schedule_steps=3"]
        if micro is not None:
            overrides.append(f"train.micro_batch_tokens={micro}")
        trainer = Trainer(micro_config(*overrides), str(tmp_path / f"run-{micro}"), quiet=True)
        try:
            assert trainer.accum == (1 if micro is None else 2)
            trainer.loader.load_state_dict({**trainer.loader.state_dict(), "windows_done": last * rows})
            trainer.loader = recorder = Recorder(trainer.loader)
            for _ in range(3):
                trainer.train_step()
            states.append(trainer.loader.state_dict())
            seed = trainer.cfg.train.seed
        finally:
            trainer.release_lease()
        per_step = len(recorder.batches) // 3
        seen.append([np.concatenate(recorder.batches[k * per_step:(k + 1) * per_step]) for k in range(3)])
    assert states[0] == states[1] and states[0]["epoch"] == 1
    for k in range(3):
        assert seen[0][k].shape == (rows, T + 1)
        assert np.array_equal(seen[0][k], seen[1][k]), f"optimizer step {k} saw other tokens"
    # and they are the global order's steps (the last of epoch 0, the first two of epoch 1)
    expected = reference_steps(stored_windows(micro_data[0]), last + 3, rows, seed)[last:]
    assert all(np.array_equal(got, want) for got, want in zip(seen[0], expected))
