"""Resumable, rank-sharded loader over packed token shards (format: `nagmoe.data.shards`).

Legend: B = rows per batch on this rank, T = seq_len, R = world size, W = windows in the split,
S = `step_rows`, the rows of one optimizer step over all ranks (train.batch_tokens // seq_len; default R·B).

Windows. Window w of the split is `seq_len + 1` ids of one shard starting at a multiple of seq_len
(x = w[:-1], y = w[1:]); windows are numbered shard by shard, so window ids are a plain range(W).

Order. Epoch e visits windows in the order `perm_e = default_rng([seed, e]).permutation(W)`. The global
batch g of an epoch is `perm_e[g·R·B : (g+1)·R·B]`; rank r takes its rows `[r·B : (r+1)·B]`. So ranks are
disjoint and together cover the epoch, and R ranks with B rows see exactly the batches of one process with
R·B rows. An epoch is `W // S` optimizer steps of S / (R·B) batches each (S must be a multiple of R·B): the
last `W mod S` windows of each epoch's order are skipped, a tail fixed by the data, the seed and S only, so
every split of an optimizer step over ranks and accumulation micro-steps (any R, B with S rows in all) sees
the same windows in every step of every epoch. The next epoch reshuffles, so no window is skipped
systematically. Legacy (a loader state saved before `step_rows` existed, issue 24): the epoch is
`W // (R·B)` batches, the tail `W mod (R·B)` skipped, and it stays so for the rest of that run.

Resume. `state_dict()` holds (epoch, windows consumed this epoch, data fingerprint, seed, seq_len, S);
`load_state_dict()` continues at exactly the next batch. A different world size or micro-batch resumes
exactly too when the global batch R·B divides the windows consumed and S is unchanged (e.g. the same
optimizer step on more ranks, or with more accumulation micro-steps); with another S the position is kept
and the epoch length follows the new S. A state without S keeps the legacy epoch length; the states the
loader then saves carry no S either.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterator, Optional, Union

import numpy as np
import torch

from nagmoe.data import shards
from nagmoe.data.bpb import bits_per_byte, bpb_sums, token_bytes, unigram_bpb  # noqa: F401  (re-exported)
from nagmoe.base.errors import UserError


def check_data_vocab(data_dir: str, vocab_size: int) -> None:
    """The trainer's guard: data tokenised with another vocabulary than model.vocab_size is a UserError."""
    index = shards.read_index(data_dir)
    if index["vocab_size"] != vocab_size:
        raise UserError(f"tokenizer/model vocab mismatch: {os.path.join(data_dir, index['tokenizer'])} "
                        f"(see {shards.INDEX}) has {index['vocab_size']} tokens, model.vocab_size={vocab_size}")


class TokenShards:
    """The memmapped shards of one split, checked at open (sizes always; sha256 and ids < vocab when verify) and
    every batch's ids again in `gather`."""

    def __init__(self, data_dir: str, split: str, verify: bool = True):
        self.data_dir, self.split = data_dir, split
        # index checked as a schema, each shard opened once (no symlink), sized, hashed and id-checked (verify)
        self.index, self.records, self.arrays = shards.open_split(data_dir, split, verify=verify)
        self.vocab_size: int = self.index["vocab_size"]
        self.bos_id: int = self.index["bos_id"]
        self.n_tokens = sum(len(a) for a in self.arrays)
        self.fingerprint = hashlib.sha256(
            "\n".join(r["sha256"] for r in self.records).encode()).hexdigest()[:16]

    def window_starts(self, seq_len: int) -> np.ndarray:
        """offsets[s] = id of the first window of shard s; offsets[-1] = W."""
        per_shard = [max(0, (len(a) - 1) // seq_len) for a in self.arrays]
        return np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)

    def gather(self, window_ids: np.ndarray, seq_len: int, offsets: np.ndarray) -> np.ndarray:
        """(len(window_ids), seq_len + 1) int64 rows."""
        shard_of = np.searchsorted(offsets, window_ids, side="right") - 1
        rows = np.empty((len(window_ids), seq_len + 1), dtype=np.int64)
        for i, (w, s) in enumerate(zip(window_ids.tolist(), shard_of.tolist())):
            start = (w - int(offsets[s])) * seq_len
            rows[i] = self.arrays[s][start:start + seq_len + 1]
        # cheap, and before any model sees them: an id outside the table would crash it (a device assert on CUDA)
        if rows.size and (int(rows.max()) >= self.vocab_size or int(rows.min()) < 0):
            bad = (rows >= self.vocab_size) | (rows < 0)
            row = int(np.argmax(bad.any(axis=1)))
            ids = rows[row][bad[row]]
            token = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            path = os.path.join(self.data_dir, self.records[int(shard_of[row])]["file"])
            raise UserError(shards.id_error(path, token, self.vocab_size))
        return rows


def _to_xy(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _check_positive(**kw) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or v <= 0:
            raise UserError(f"{name}: {v!r} must be a positive integer")


class TokenLoader:
    """Infinite iterator of (x_BT, y_BT) int64 training batches for one data-parallel rank."""

    def __init__(self, data_dir: str, split: str, seq_len: int, batch_size_rows: int, seed: int,
                 rank: int = 0, world_size: int = 1, verify: bool = True, step_rows: Optional[int] = None):
        """`step_rows`: rows of one optimizer step over all ranks (a multiple of world_size · batch_size_rows;
        default that product, i.e. no accumulation); the epoch's skipped tail is `W mod step_rows`."""
        _check_positive(seq_len=seq_len, batch_size_rows=batch_size_rows, world_size=world_size)
        if step_rows is None:
            step_rows = world_size * batch_size_rows
        _check_positive(step_rows=step_rows)
        if step_rows % (world_size * batch_size_rows):
            raise UserError(f"loader: {step_rows} rows per optimizer step are not a multiple of the global batch "
                            f"({world_size} ranks x {batch_size_rows} rows)")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside [0, world_size={world_size})")
        self.data = TokenShards(data_dir, split, verify=verify)
        self.split, self.seq_len, self.batch_size_rows, self.seed = split, seq_len, batch_size_rows, seed
        self.rank, self.world_size = rank, world_size
        self._offsets = self.data.window_starts(seq_len)
        self.n_windows = int(self._offsets[-1])
        self.global_rows = world_size * batch_size_rows
        if self.n_windows < step_rows:
            raise UserError(f"{os.path.join(data_dir, shards.INDEX)}: the {split} split has {self.n_windows} "
                            f"windows of {seq_len + 1} tokens, fewer than one global batch of {step_rows} "
                            "rows; use a smaller batch or seq_len, or more data")
        self._configured_step_rows = step_rows
        self._set_step_rows(step_rows)
        self.epoch, self.batch_in_epoch = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _set_step_rows(self, step_rows: Optional[int]) -> None:
        """None: the legacy epoch (issue 24), `W // (R·B)` batches; else `W // S` steps of S / (R·B) batches."""
        self.step_rows = step_rows
        if step_rows is None:
            self.batches_per_epoch = self.n_windows // self.global_rows
        else:
            self.batches_per_epoch = (self.n_windows // step_rows) * (step_rows // self.global_rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        first = self.batch_in_epoch * self.global_rows + self.rank * self.batch_size_rows
        ids = self._permutation(self.epoch)[first:first + self.batch_size_rows]
        self.batch_in_epoch += 1
        return _to_xy(self.data.gather(ids, self.seq_len, self._offsets))

    def state_dict(self) -> dict:
        """JSON-able position: the next call after load_state_dict returns the batch that would come next.
        A legacy loader (see load_state_dict) saves no "step_rows", so its run stays legacy."""
        state = {"split": self.split, "seq_len": self.seq_len, "seed": self.seed,
                 "fingerprint": self.data.fingerprint, "n_windows": self.n_windows, "epoch": self.epoch,
                 "windows_done": self.batch_in_epoch * self.global_rows}
        if self.step_rows is not None:
            state["step_rows"] = self.step_rows
        return state

    def load_state_dict(self, state: dict) -> None:
        now = {"split": self.split, "seq_len": self.seq_len, "seed": self.seed, "fingerprint": self.data.fingerprint}
        for key, value in now.items():
            if state.get(key) != value:
                raise UserError(f"loader state does not match this data: {key}={state.get(key)!r} in the "
                                f"checkpoint, {value!r} now ({self.data.data_dir})")
        done = int(state["windows_done"])
        if done % self.global_rows:
            raise UserError(f"loader state: {done} windows consumed is not a multiple of the global batch "
                            f"({self.world_size} ranks x {self.batch_size_rows} rows); keep the global batch")
        # no "step_rows": a state from before issue 24, whose epoch skipped the tail W mod (R·B) (legacy); a
        # state with another S (a forced resume with another batch) keeps its position, the epoch follows S now
        self._set_step_rows(None if state.get("step_rows") is None else self._configured_step_rows)
        self.epoch, self.batch_in_epoch = int(state["epoch"]), done // self.global_rows


def iter_eval_batches(data: Union[str, TokenShards], seq_len: int, batch_size_rows: int, split: str = "val",
                      max_tokens: Optional[int] = None, rank: int = 0, world_size: int = 1,
                      verify: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic pass over a split: windows in stored order, batches of B consecutive windows (the last
    may be shorter), batch k on rank k mod R. `max_tokens` keeps the first max(1, max_tokens // seq_len)
    windows. Pass a `TokenShards` to evaluate repeatedly without re-verifying the shards."""
    for _, x, y in iter_eval_windows(data, seq_len, batch_size_rows, split=split, max_tokens=max_tokens,
                                     sample="first", rank=rank, world_size=world_size, verify=verify):
        yield x, y


def iter_eval_windows(data: Union[str, TokenShards], seq_len: int, batch_size_rows: int, split: str = "val",
                      max_tokens: Optional[int] = None, sample: str = "strided",
                      window_ids: Optional[np.ndarray] = None, rank: int = 0, world_size: int = 1,
                      verify: bool = True) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """(window ids, x_BT, y_BT) over an eval sample (nagmoe/data/eval_sample.py: `sample` of `max_tokens`, or the
    `window_ids` given): batches of B consecutive sample windows (the last may be shorter), batch k on rank
    k mod R, so the batches, and so every window's numbers, are the same on any number of ranks."""
    from nagmoe.data.eval_sample import eval_window_ids

    _check_positive(seq_len=seq_len, batch_size_rows=batch_size_rows, world_size=world_size)
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is outside [0, world_size={world_size})")
    shards_ = data if isinstance(data, TokenShards) else TokenShards(data, split, verify=verify)
    offsets = shards_.window_starts(seq_len)
    n_windows = int(offsets[-1])
    if n_windows == 0:
        raise UserError(f"{shards_.data_dir}: the {shards_.split} split holds no window of {seq_len + 1} tokens")
    if window_ids is None:
        ids = eval_window_ids(n_windows, max_tokens, seq_len, sample)
    else:
        ids = np.asarray(window_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n_windows):
            raise UserError(f"{shards_.data_dir}: eval window ids outside the {shards_.split} split's "
                            f"{n_windows} windows of {seq_len + 1} tokens")
    for k, first in enumerate(range(0, len(ids), batch_size_rows)):
        if k % world_size == rank:
            batch = ids[first:first + batch_size_rows]
            yield (batch, *_to_xy(shards_.gather(batch, seq_len, offsets)))
