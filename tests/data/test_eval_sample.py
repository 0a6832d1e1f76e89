"""The eval sample of issue 66 (nagmoe/data/eval_sample.py, nagmoe/data/loader.py's iter_eval_windows).

On a val split of about a dozen shards (the small corpus prepared with a small `data.shard_tokens`):
  * the strided sample of n windows has a window in every val shard; the "first" sample of the same n does not;
  * the sample is keyed on the data and seq_len only: two data dirs prepared from the same corpus give the same ids
    and the same sample fingerprint; another seq_len or other data (one held-out document fewer) another
    fingerprint; the ranks and rows per batch change who scores which window, never which windows are scored;
  * ids are distinct, ascending, in [0, W), n = min(W, max(1, tokens // seq_len)), window k of the strided sample
    is floor((2k + 1)·W / (2n));
  * iter_eval_batches is the pre-issue-66 pass exactly: windows 0..n-1 in stored order, batches of B consecutive
    windows, batch k on rank k mod R (checked against windows read straight from the shard files).
"""
import json
import math
import os

import numpy as np
import pytest
import torch

from nagmoe.base.errors import UserError
from nagmoe.config import load_config
from nagmoe.data.corpus import is_val_document
from nagmoe.data.eval_sample import eval_window_ids, sample_fingerprint, sample_size
from nagmoe.data.loader import TokenShards, iter_eval_batches, iter_eval_windows
from nagmoe.data.shards import read_index

T = 64
VAL_SHARDS = 12
N = 24  # windows of the sample in the shard tests: W / N is about half a shard


def _prepare(root, name, corpus, tokenizer, shard_tokens, make_config):
    from nagmoe.data.prepare import prepare_single

    data_dir = root / name
    path = make_config(root / f"{name}.yaml", corpus, data_dir, shard_tokens=shard_tokens, tokenizer=tokenizer)
    prepare_single(load_config(path))
    return str(data_dir)


@pytest.fixture(scope="module")
def split(tmp_path_factory, scenes, prepared, make_config):
    """{same_a, same_b, changed}: the 140 scenes prepared twice into two data dirs with shard_tokens set so the
    val split has VAL_SHARDS nearly equal shards, and once without one held-out scene (the given tokenizer of
    `prepared`: no BPE training)."""
    root = tmp_path_factory.mktemp("eval_sample")
    tokenizer = os.path.join(prepared[2], "tokenizer.json")

    def corpus(name, docs):
        with open(root / name, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        return root / name

    full = corpus("full.jsonl", scenes)
    probe = _prepare(root, "probe", full, tokenizer, 10 ** 8, make_config)
    val_tokens = TokenShards(probe, "val").n_tokens
    shard_tokens = math.ceil(val_tokens / VAL_SHARDS)  # the last shard >= val_tokens / 12 - 11 tokens
    held_out = next(i for i, s in enumerate(scenes) if is_val_document(s, 0.1))
    less = corpus("less.jsonl", scenes[:held_out] + scenes[held_out + 1:])
    return {"same_a": _prepare(root, "same_a", full, tokenizer, shard_tokens, make_config),
            "same_b": _prepare(root, "same_b", full, tokenizer, shard_tokens, make_config),
            "changed": _prepare(root, "changed", less, tokenizer, shard_tokens, make_config)}


def shard_windows(data_dir, seq_len=T):
    """Every window of the val split read straight from the shard files (not through TokenShards), numbered
    shard by shard: ((W, seq_len + 1) int64 rows, the shard of each window)."""
    rows, shard_of = [], []
    val = [r for r in read_index(data_dir)["shards"] if r["split"] == "val"]
    for s, r in enumerate(val):
        ids = np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"]).astype(np.int64)
        for k in range((len(ids) - 1) // seq_len):
            rows.append(ids[k * seq_len:k * seq_len + seq_len + 1])
            shard_of.append(s)
    return np.stack(rows), np.array(shard_of)


def test_the_strided_sample_has_a_window_in_every_val_shard_and_the_first_does_not(split):
    rows, shard_of = shard_windows(split["same_a"])
    n_shards, W = int(shard_of.max()) + 1, len(rows)
    per_shard = np.bincount(shard_of)
    assert n_shards == VAL_SHARDS and per_shard.min() >= W / N  # every shard is at least one stratum long
    max_tokens = N * T + T - 1  # floor: still N windows
    strided = eval_window_ids(W, max_tokens, T, "strided")
    first = eval_window_ids(W, max_tokens, T, "first")
    assert len(strided) == len(first) == N
    assert set(shard_of[strided].tolist()) == set(range(n_shards))
    assert len(set(shard_of[first].tolist())) < n_shards  # the first windows: the first shard(s) only
    assert set(shard_of[first].tolist()) == {0}
    # the loader yields the windows the ids name (rows read straight from the shard files)
    got_ids, got_rows = [], []
    for ids, x, y in iter_eval_windows(split["same_a"], T, 5, max_tokens=max_tokens):
        assert torch.equal(x[:, 1:], y[:, :-1])
        got_ids.append(ids)
        got_rows.append(torch.cat([x, y[:, -1:]], dim=1).numpy())
    assert np.concatenate(got_ids).tolist() == strided.tolist()
    np.testing.assert_array_equal(np.concatenate(got_rows), rows[strided])


def test_the_sample_depends_on_the_data_and_seq_len_only(split):
    a, b, changed = (TokenShards(split[k], "val") for k in ("same_a", "same_b", "changed"))
    assert a.fingerprint == b.fingerprint != changed.fingerprint
    for seq_len in (T, 32):
        for max_tokens in (T, 7 * T, N * T, 10 ** 9):
            ids_a = eval_window_ids(int(a.window_starts(seq_len)[-1]), max_tokens, seq_len)
            ids_b = eval_window_ids(int(b.window_starts(seq_len)[-1]), max_tokens, seq_len)
            assert ids_a.tolist() == ids_b.tolist()
            assert sample_fingerprint(a.fingerprint, seq_len, ids_a) == sample_fingerprint(b.fingerprint, seq_len,
                                                                                          ids_b)
            # other data: another fingerprint, also for the very same ids
            ids_c = eval_window_ids(int(changed.window_starts(seq_len)[-1]), max_tokens, seq_len)
            assert sample_fingerprint(changed.fingerprint, seq_len, ids_c) != sample_fingerprint(
                a.fingerprint, seq_len, ids_a)
            assert sample_fingerprint(changed.fingerprint, seq_len, ids_a) != sample_fingerprint(
                a.fingerprint, seq_len, ids_a)
    # another seq_len: another sample fingerprint (for the same ids too)
    ids64 = eval_window_ids(int(a.window_starts(T)[-1]), N * T, T)
    ids32 = eval_window_ids(int(a.window_starts(32)[-1]), N * T, 32)
    assert ids64.tolist() != ids32.tolist()
    assert len({sample_fingerprint(a.fingerprint, T, ids64), sample_fingerprint(a.fingerprint, 32, ids32),
                sample_fingerprint(a.fingerprint, 32, ids64)}) == 3
    # any ranks and rows per batch: the same windows, each scored once, batch k (B consecutive ones) on rank k mod R
    for R in (1, 2, 3):
        for B in (1, 5):
            batches = {}
            for r in range(R):
                for k, (ids, _, _) in enumerate(iter_eval_windows(a, T, B, max_tokens=N * T, rank=r, world_size=R)):
                    batches[k * R + r] = ids.tolist()
            assert [batches[k] for k in sorted(batches)] == [ids64[i:i + B].tolist() for i in range(0, N, B)]


@pytest.mark.parametrize("sample", ["strided", "first"])
def test_ids_are_distinct_ascending_in_range_and_sized_by_the_rule(sample):
    for W in (1, 2, 3, 7, 10, 46, 835, 1000, 10_007):
        for max_tokens in (None, 0, 1, T - 1, T, T + 1, 3 * T, 37 * T + 5, W * T - 1, W * T, 2 * W * T):
            n = W if max_tokens is None else min(W, max(1, max_tokens // T))
            assert sample_size(W, max_tokens, T) == n
            ids = eval_window_ids(W, max_tokens, T, sample)
            assert ids.dtype == np.int64 and len(ids) == n, (W, max_tokens)
            assert len(set(ids.tolist())) == n and (np.diff(ids) > 0).all(), (W, max_tokens)
            assert 0 <= ids[0] and ids[-1] < W
            if sample == "first" or n == W:
                assert ids.tolist() == list(range(n))
            else:  # the centre of each of n equal strata of 0..W-1
                assert ids.tolist() == [(2 * k + 1) * W // (2 * n) for k in range(n)]
                # the floor of a point of stratum k; so no L = ceil(W / n) consecutive windows (a shard of at least
                # W / n windows) miss the sample
                assert all(k * W // n <= i and i * n < (k + 1) * W for k, i in enumerate(ids.tolist()))
                L = -(-W // n)
                assert ids[0] < L and W - 1 - ids[-1] < L and (np.diff(ids) <= L).all(), (W, max_tokens)
    assert eval_window_ids(0, 1000, T, sample).tolist() == []
    with pytest.raises(UserError, match="not one of strided, first"):
        eval_window_ids(10, 1000, T, "random")


def test_iter_eval_batches_is_the_old_first_windows_pass(split):
    data_dir = split["same_a"]
    rows, _ = shard_windows(data_dir)
    W = len(rows)
    shards_ = TokenShards(data_dir, "val")
    for max_tokens in (None, 1, 7 * T + 5, N * T, 200 * T, 10 ** 9):
        n = W if max_tokens is None else min(W, max(1, max_tokens // T))
        for B in (1, 5, 64):
            for R in (1, 3):
                for r in range(R):
                    want = [rows[first:min(first + B, n)] for k, first in enumerate(range(0, n, B)) if k % R == r]
                    got = list(iter_eval_batches(shards_, T, B, max_tokens=max_tokens, rank=r, world_size=R))
                    assert len(got) == len(want), (max_tokens, B, R, r)
                    for (x, y), w in zip(got, want):
                        assert x.dtype == y.dtype == torch.int64
                        assert torch.equal(x, torch.from_numpy(w[:, :-1]))
                        assert torch.equal(y, torch.from_numpy(w[:, 1:]))
    assert 200 > W / VAL_SHARDS  # 200 windows from the start cross shard boundaries
    # from a data dir path as well (verified on open)
    first = next(iter_eval_batches(data_dir, T, 3, max_tokens=3 * T))
    assert torch.equal(first[0], torch.from_numpy(rows[:3, :-1]))


def test_window_ids_outside_the_split_are_a_user_error(split):
    shards_ = TokenShards(split["same_a"], "val")
    W = int(shards_.window_starts(T)[-1])
    for bad in ([W], [-1], [0, W + 5]):
        with pytest.raises(UserError, match=f"outside the val split's {W} windows"):
            list(iter_eval_windows(shards_, T, 4, window_ids=np.array(bad)))
    ids, x, _ = next(iter_eval_windows(shards_, T, 4, window_ids=np.array([W - 1])))
    assert ids.tolist() == [W - 1] and x.shape == (1, T)
