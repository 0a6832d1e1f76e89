"""TokenLoader: batches, exact resume, rank sharding; eval pass; bytes per token; unigram bpb."""
import json
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch

from nagmoe.data.corpus import is_val_document, iter_documents, resolve_corpus
from nagmoe.data.loader import (TokenLoader, TokenShards, bpb_sums, check_data_vocab, iter_eval_batches,
                                token_bytes, unigram_bpb)
from nagmoe.data.shards import read_index
from nagmoe.base.errors import UserError

T = 64


def all_windows(data_dir, split):
    """Every training window of the split, computed straight from the shard files."""
    out = Counter()
    for r in read_index(data_dir)["shards"]:
        if r["split"] == split:
            ids = np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"]).astype(np.int64)
            for k in range((len(ids) - 1) // T):
                out[tuple(ids[k * T:k * T + T + 1].tolist())] += 1
    return out


def rows(x, y):
    return [tuple(r) for r in torch.cat([x, y[:, -1:]], dim=1).tolist()]


def test_batches_are_shifted_int64_windows(prepared):
    data_dir = prepared[2]
    x, y = next(TokenLoader(data_dir, "train", T, 4, seed=0))
    assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = all_windows(data_dir, "train")
    assert all(r in windows for r in rows(x, y))


def test_resume_gives_the_identical_next_batches_across_an_epoch_end(prepared):
    data_dir = prepared[2]
    a = TokenLoader(data_dir, "train", T, 1024, seed=3)
    assert 3 <= a.batches_per_epoch < 12
    for _ in range(a.batches_per_epoch - 2):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [next(a) for _ in range(5)]  # runs into the next epoch
    b = TokenLoader(data_dir, "train", T, 1024, seed=3)
    b.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(expected, (next(b) for _ in range(5))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = TokenLoader(data_dir, "train", T, 1024, seed=4)  # another seed is another order
    assert not torch.equal(next(c)[0], next(TokenLoader(data_dir, "train", T, 1024, seed=3))[0])


def test_epochs_reshuffle(prepared):
    loader = TokenLoader(prepared[2], "train", T, 1024, seed=0)
    first = [rows(*next(loader)) for _ in range(loader.batches_per_epoch)]
    second = [rows(*next(loader)) for _ in range(loader.batches_per_epoch)]
    assert loader.epoch == 1 and first != second


def test_rank_shards_are_disjoint_and_complete(prepared):
    data_dir, R, B = prepared[2], 3, 40
    ranks = [TokenLoader(data_dir, "train", T, B, seed=1, rank=r, world_size=R) for r in range(R)]
    single = TokenLoader(data_dir, "train", T, R * B, seed=1)
    windows = all_windows(data_dir, "train")
    assert single.n_windows == sum(windows.values())
    seen = Counter()
    for _ in range(single.batches_per_epoch):
        per_rank = [rows(*next(loader)) for loader in ranks]
        assert sum(per_rank, []) == rows(*next(single))  # R ranks x B rows == 1 process x R·B rows
        for r in per_rank:
            seen.update(r)
    assert all(seen[w] <= windows[w] for w in seen)  # no window twice in an epoch (disjoint)
    assert sum(seen.values()) == single.batches_per_epoch * R * B
    assert single.n_windows - sum(seen.values()) < R * B  # complete up to the dropped remainder


def test_resume_on_another_world_size_with_the_same_global_batch(prepared):
    data_dir = prepared[2]
    one = TokenLoader(data_dir, "train", T, 8, seed=2)
    for _ in range(5):
        next(one)
    state = one.state_dict()
    expected = rows(*next(one))
    two = [TokenLoader(data_dir, "train", T, 4, seed=2, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    assert rows(*next(two[0])) + rows(*next(two[1])) == expected
    odd = TokenLoader(data_dir, "train", T, 3, seed=2)
    with pytest.raises(UserError, match="global batch"):
        odd.load_state_dict(state)


def test_state_from_other_data_or_seed_is_refused(prepared):
    loader = TokenLoader(prepared[2], "train", T, 8, seed=0)
    with pytest.raises(UserError, match="seed"):
        loader.load_state_dict({**loader.state_dict(), "seed": 1})
    with pytest.raises(UserError, match="fingerprint"):
        loader.load_state_dict({**loader.state_dict(), "fingerprint": "0" * 16})


def test_too_few_windows_for_a_batch_is_a_user_error(prepared):
    with pytest.raises(UserError, match="fewer than one global batch"):
        TokenLoader(prepared[2], "val", T, 100_000, seed=0)


def test_eval_pass_is_deterministic_ordered_and_rank_complete(prepared):
    data_dir = prepared[2]
    shards = TokenShards(data_dir, "val")
    full = [rows(x, y) for x, y in iter_eval_batches(shards, T, 16)]
    again = [rows(x, y) for x, y in iter_eval_batches(data_dir, T, 16)]
    assert full == again
    stored = []
    for r in read_index(data_dir)["shards"]:
        if r["split"] == "val":
            ids = np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"]).tolist()
            stored += [tuple(ids[k * T:k * T + T + 1]) for k in range((len(ids) - 1) // T)]
    assert sum(full, []) == stored
    by_rank = [[rows(x, y) for x, y in iter_eval_batches(shards, T, 16, rank=r, world_size=2)] for r in range(2)]
    interleaved = [b for k in range(len(full)) for b in [by_rank[k % 2][k // 2]]]
    assert interleaved == full
    limited = sum((rows(x, y) for x, y in iter_eval_batches(shards, T, 16, max_tokens=10 * T)), [])
    assert limited == stored[:10]


def test_token_bytes_count_the_utf8_text(prepared, small_corpus):
    _, cfg, data_dir = prepared
    nbytes = token_bytes(data_dir)
    assert nbytes.shape == (512,) and nbytes[0] == 0 and (nbytes[1:] > 0).all()
    val_ids = np.concatenate([np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"])
                              for r in read_index(data_dir)["shards"] if r["split"] == "val"])
    docs = [d for d in iter_documents(resolve_corpus(str(small_corpus)))
            if is_val_document(d, cfg.data.val_fraction)]
    assert int(nbytes[torch.from_numpy(val_ids.astype(np.int64))].sum()) == sum(len(d.encode()) for d in docs)


def test_bpb_sums_leave_bos_targets_out():
    nbytes = torch.tensor([0, 1, 3])
    y = torch.tensor([[0, 1, 2, 2]])
    loss = torch.tensor([[5.0, 1.0, 2.0, 3.0]])
    assert bpb_sums(loss, y, nbytes) == (6.0, 7)


def test_unigram_bpb_is_sane(prepared):
    bpb = unigram_bpb(prepared[2])
    assert 1.0 < bpb < 16.0 and math.isfinite(bpb)


def test_data_vocab_must_match_the_model(prepared):
    check_data_vocab(prepared[2], 512)
    with pytest.raises(UserError, match="tokenizer/model vocab mismatch") as e:
        check_data_vocab(prepared[2], 4096)
    assert "tokenizer.json" in str(e.value)
