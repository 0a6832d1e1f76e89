"""Bits per byte: tokenizer-independent loss, and the unigram baseline.

    bpb = Σ_t nats_t / (ln 2 · Σ_t bytes(y_t))

summed over target tokens whose byte count is > 0: special tokens (BOS) stand for no text, so they are
left out of both sums (their loss is not a cost of compressing text).
"""
from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch

from nagmoe.data import shards
from nagmoe.data.tokenizer import read_tokenizer_bytes, token_byte_lengths, tokenizer_from_bytes
from nagmoe.base.errors import UserError


def token_bytes(data_dir: str) -> torch.Tensor:
    """int64 (V,): UTF-8 bytes per token id of data_dir's tokenizer (0 for BOS/special tokens).

    The tokenizer is data_dir's `tokenizer.json` (the only name index.json may give) and must be the one index.json
    was made with (sha256, of the very bytes loaded), else a UserError naming it."""
    index = shards.read_index(data_dir)
    path = os.path.join(data_dir, shards.TOKENIZER)
    data = read_tokenizer_bytes(path)
    if hashlib.sha256(data).hexdigest() != index["tokenizer_sha256"]:
        raise UserError(f"{path}: not the tokenizer {os.path.join(data_dir, shards.INDEX)} was made with "
                        "(sha256 differs); re-run nagmoe prepare-data")
    return torch.from_numpy(token_byte_lengths(tokenizer_from_bytes(data, path)))


def bpb_sums(loss_BT: torch.Tensor, y_BT: torch.Tensor, token_bytes_V: torch.Tensor) -> tuple[float, int]:
    """(Σ nats, Σ bytes) over targets with bytes > 0, from per-token losses in nats (reduction='none')."""
    nbytes_BT = token_bytes_V.to(y_BT.device)[y_BT]
    counted = nbytes_BT > 0
    return float(loss_BT.float()[counted].sum()), int(nbytes_BT.sum())


def bits_per_byte(nats: float, n_bytes: int) -> float:
    return nats / (math.log(2) * n_bytes) if n_bytes else float("nan")


def _split_counts(data_dir: str, index: dict, split: str, vocab: int, verify: bool,
                  chunk: int = 1 << 24) -> np.ndarray:
    """Counts of each id in a split, its shards opened as the loader opens them (shards.open_split)."""
    counts = np.zeros(vocab, dtype=np.int64)
    _, records, arrays = shards.open_split(data_dir, split, verify=verify, index=index)
    for rec, mm in zip(records, arrays):
        for i in range(0, len(mm), chunk):
            c = np.bincount(mm[i:i + chunk], minlength=vocab)
            if len(c) > vocab:  # unverified shards: an id past the vocabulary (verified ones were checked)
                raise UserError(shards.id_error(os.path.join(data_dir, rec["file"]), len(c) - 1, vocab))
            counts += c
    return counts


def unigram_bpb(data_dir: str, verify: bool = True) -> float:
    """bpb of a unigram model fit to train-split token frequencies, evaluated on every val-split token.

    Laplace (add-one) smoothing, so every id has mass: p(v) = (c_v + 1) / (N + V), with c_v the count of
    id v among the N train tokens (BOS included; it is a token the model predicts too) and V the vocabulary
    size. Val: Σ_v c'_v · (-ln p(v)) / (ln 2 · Σ_v c'_v · bytes(v)) over val ids with bytes(v) > 0. This is
    the bpb of a model that ignores context: a trained model must beat it. `verify`: check the shards' sha256
    (as data.verify_shards; sizes and ids are always checked).
    """
    index = shards.read_index(data_dir)
    vocab = index["vocab_size"]
    train = _split_counts(data_dir, index, "train", vocab, verify)
    val = _split_counts(data_dir, index, "val", vocab, verify)
    nbytes = token_bytes(data_dir).numpy()
    log_p = np.log(train + 1.0) - math.log(train.sum() + vocab)
    counted = nbytes > 0
    nats = -(val[counted] * log_p[counted]).sum()
    return bits_per_byte(float(nats), int((val * nbytes).sum()))
