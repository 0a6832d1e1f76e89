"""Which validation windows an evaluation scores (issue 66): a sample spread over the whole split, keyed only on
the data and `seq_len`, so every run of a comparison scores the very same windows and their losses pair.

Windows are the loader's (nagmoe/data/loader.py): window w is `seq_len + 1` ids of one shard starting at a multiple
of seq_len, numbered shard by shard, W in the split. A sample of n = min(W, max(1, max_tokens // seq_len)) windows:

  strided  window k = floor((2k + 1)·W / (2n)), k = 0..n-1: the centre of each of n equal strata of the numbering,
           so every shard of at least W/n windows holds one, the windows are distinct (n <= W), and the sample
           depends on W, seq_len and n only (W on the data and seq_len). Stratified rather than a seeded draw: it
           covers every shard by construction, and windows far apart in the split are from different documents,
           which is what makes them independent units for the paired interval (nagmoe/analysis/paired.py).
  first    windows 0..n-1 in stored order: the held-out documents of the first input files only. The sample of
           every run before issue 66 (the legacy value of `train.eval_sample`), kept so old runs' numbers stay.

`sample_fingerprint` names a sample: the data fingerprint, seq_len and the window ids. Two runs' per-window losses
pair only on windows with the same id under the same data fingerprint and seq_len.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from nagmoe.base.errors import UserError

SAMPLES = ("strided", "first")


def sample_size(n_windows: int, max_tokens: Optional[int], seq_len: int) -> int:
    """n = min(W, max(1, max_tokens // seq_len)); every window when max_tokens is None."""
    if max_tokens is None:
        return n_windows
    return min(n_windows, max(1, max_tokens // seq_len))


def eval_window_ids(n_windows: int, max_tokens: Optional[int], seq_len: int, sample: str = "strided") -> np.ndarray:
    """int64 window ids of the sample, ascending (see the module docstring)."""
    if sample not in SAMPLES:
        raise UserError(f"eval sample {sample!r} is not one of {', '.join(SAMPLES)}")
    n = sample_size(n_windows, max_tokens, seq_len)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if sample == "first" or n == n_windows:
        return np.arange(n, dtype=np.int64)
    k = np.arange(n, dtype=np.int64)
    return (2 * k + 1) * n_windows // (2 * n)


def sample_fingerprint(data_fingerprint: str, seq_len: int, window_ids: np.ndarray) -> str:
    """16 hex digits of sha256(data fingerprint, seq_len, the ids as little-endian int64)."""
    h = hashlib.sha256(f"{data_fingerprint}:{int(seq_len)}:".encode())
    h.update(np.asarray(window_ids, dtype="<i8").tobytes())
    return h.hexdigest()[:16]
