"""Per-window validation losses (issue 66): what the final eval keeps, so two runs can be compared window by window.

For each window of the eval sample (nagmoe/data/eval_sample.py): its id, Σ nats over its counted targets (those
with bytes > 0, as nagmoe/data/bpb.py counts them), Σ bytes and the number of counted targets. bpb of any set of
windows is Σ nats / (ln 2 · Σ bytes), so the per-window numbers give the run's val bpb, and two runs that scored
the same windows give a paired difference (nagmoe/analysis/paired.py).

The file, RUN_DIR/eval_windows.json (`EVAL_WINDOWS_FILE`, nagmoe/rundir/names.py), columnar JSON:
    {"format": "nagmoe.eval_windows", "version": 1, "split": "val", "data_fingerprint": str, "seq_len": int,
     "sample": "strided" | "first" | "given", "split_windows": W, "sample_fingerprint": str, "step": int,
     "window_ids": [int, ascending, < W], "nats": [float >= 0], "bytes": [int >= 0], "tokens": [int >= 0]}
Read back as possibly written by someone else: bounded in size and windows, every field checked, the sample's
fingerprint recomputed from the ids; anything else is a UserError naming the file and field.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import NUMBER, atomic_writer, expect, expect_object, read_json
from nagmoe.data.bpb import bits_per_byte
from nagmoe.data.eval_sample import SAMPLES, sample_fingerprint
from nagmoe.rundir.names import EVAL_WINDOWS_FILE

FORMAT, VERSION = "nagmoe.eval_windows", 1
MAX_FILE_BYTES = 256 << 20  # ~4M windows at ~60 bytes each; a larger file is not ours
MAX_WINDOWS = 4_000_000  # 8B tokens at seq_len 2048: beyond any val split we evaluate
INT64_MAX = 2 ** 63 - 1


@dataclass
class WindowLosses:
    """One run's losses on one eval sample, ids ascending."""
    data_fingerprint: str
    seq_len: int
    sample: str  # strided | first | given (ids chosen by the caller, e.g. `nagmoe compare`)
    split_windows: int
    window_ids: np.ndarray  # int64 (n,)
    nats: np.ndarray  # float64 (n,)
    bytes: np.ndarray  # int64 (n,)
    tokens: np.ndarray  # int64 (n,)
    step: Optional[int] = None
    split: str = "val"

    @property
    def fingerprint(self) -> str:
        return sample_fingerprint(self.data_fingerprint, self.seq_len, self.window_ids)

    @property
    def bpb(self) -> float:
        return bits_per_byte(float(self.nats.sum()), int(self.bytes.sum()))

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "split": self.split, "data_fingerprint": self.data_fingerprint,
                "seq_len": int(self.seq_len), "sample": self.sample, "split_windows": int(self.split_windows),
                "sample_fingerprint": self.fingerprint, "step": self.step,
                "window_ids": self.window_ids.tolist(), "nats": [float(v) for v in self.nats],
                "bytes": self.bytes.tolist(), "tokens": self.tokens.tolist()}


class WindowAccumulator:
    """Collects per-window sums batch by batch; `merge` sorts every rank's by window id."""

    def __init__(self, token_bytes_V: torch.Tensor):
        self.token_bytes_V = token_bytes_V
        self.ids, self.nats, self.bytes, self.tokens = [], [], [], []

    def add(self, ids: np.ndarray, loss_BT: torch.Tensor, y_BT: torch.Tensor) -> None:
        """loss_BT: per-token nats (reduction='none'); summed per row in float64 over counted targets."""
        nbytes_BT = self.token_bytes_V.to(y_BT.device)[y_BT]
        counted_BT = nbytes_BT > 0
        nats_B = torch.where(counted_BT, loss_BT.double(), 0.0).sum(dim=1)
        # one copy to the host: byte and token counts are exact in float64
        sums_3B = torch.stack([nats_B, nbytes_BT.sum(dim=1).double(), counted_BT.sum(dim=1).double()]).cpu().numpy()
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.nats.append(sums_3B[0])
        self.bytes.append(sums_3B[1].astype(np.int64))
        self.tokens.append(sums_3B[2].astype(np.int64))

    def columns(self) -> tuple:
        """(ids, nats, bytes, tokens) of what was added here (one rank's share)."""
        cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dtype=dt))
        return (cat(self.ids, np.int64), cat(self.nats, np.float64), cat(self.bytes, np.int64),
                cat(self.tokens, np.int64))

    @staticmethod
    def merge(parts: list, data_fingerprint: str, seq_len: int, sample: str, split_windows: int,
              step: Optional[int] = None) -> WindowLosses:
        """Every rank's `columns()` into one WindowLosses, ids ascending (each window scored once)."""
        ids, nats, nbytes, tokens = (np.concatenate([p[i] for p in parts]) for i in range(4))
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if ids.size > 1 and (np.diff(ids) <= 0).any():
            raise ValueError("eval windows: a window was scored twice")
        return WindowLosses(data_fingerprint, seq_len, sample, split_windows, ids.astype(np.int64),
                            nats[order].astype(np.float64), nbytes[order].astype(np.int64),
                            tokens[order].astype(np.int64), step)


@torch.no_grad()
def score_windows(model, shards, seq_len: int, window_ids: np.ndarray, batch_rows: int, token_bytes_V: torch.Tensor,
                  device="cpu", autocast=None, sample: str = "given", step: Optional[int] = None) -> WindowLosses:
    """One process: the model's per-window losses on `window_ids` of `shards` (a TokenShards), in batches of
    `batch_rows` consecutive sample windows as the trainer's eval forms them."""
    from nagmoe.data.loader import iter_eval_windows

    was_training = model.training
    model.eval()
    acc = WindowAccumulator(token_bytes_V)
    for ids, x, y in iter_eval_windows(shards, seq_len, batch_rows, window_ids=window_ids):
        x, y = x.to(device), y.to(device)
        with (autocast if autocast is not None else nullcontext()):
            out = model(x, y, reduction="none")
        acc.add(ids, out.loss, y)
    model.train(was_training)
    n_windows = int(shards.window_starts(seq_len)[-1])
    return WindowAccumulator.merge([acc.columns()], shards.fingerprint, seq_len, sample, n_windows, step)


# ----------------------------------------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------------------------------------
def write_window_losses(run_dir: str, losses: WindowLosses) -> str:
    path = os.path.join(run_dir, EVAL_WINDOWS_FILE)
    with atomic_writer(path) as f:  # a fresh temporary, renamed (nagmoe.base.files)
        json.dump(losses.to_json(), f, separators=(",", ":"))
    return path


def _column(obj: dict, key: str, kind, n: int, where: str, minimum=0) -> np.ndarray:
    values = expect(obj, key, list, where)
    if len(values) != n:
        raise UserError(f"{where}: field {key!r} has {len(values)} entries, window_ids {n}")
    for i, v in enumerate(values):
        ok = isinstance(v, kind) and not isinstance(v, bool) and (not isinstance(v, float) or math.isfinite(v))
        if not ok or v < minimum or (kind is not NUMBER and v > INT64_MAX):  # an int64 column holds it
            raise UserError(f"{where}: {key}[{i}] must be " + ("a number >= " if kind is NUMBER else "an integer in [")
                            + f"{minimum}{'' if kind is NUMBER else ', 2**63)'}, got {shown(v, 40)}")
    return np.asarray(values, dtype=np.float64 if kind is NUMBER else np.int64)


def read_window_losses(run_dir: str) -> Optional[WindowLosses]:
    """RUN_DIR's kept per-window losses, checked (None when there is no file; UserError when it is not ours)."""
    path = os.path.join(run_dir, EVAL_WINDOWS_FILE)
    if not os.path.lexists(path):
        return None
    where = shown(path)
    if not os.path.isfile(path) or os.path.islink(path):
        raise UserError(f"{where}: not a regular file")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise UserError(f"{where}: {os.path.getsize(path):,} bytes, more than eval windows ever take "
                        f"({MAX_FILE_BYTES:,})")
    obj = expect_object(read_json(path), where)
    if obj.get("format") != FORMAT or type(obj.get("version")) is not int or obj["version"] != VERSION:  # not True
        raise UserError(f"{where}: not a {FORMAT} file of version {VERSION} (format {shown(obj.get('format'), 40)}, "
                        f"version {shown(obj.get('version'), 20)})")
    data_fp = expect(obj, "data_fingerprint", str, where)
    seq_len = expect(obj, "seq_len", int, where)
    sample = expect(obj, "sample", str, where)
    split_windows = expect(obj, "split_windows", int, where)
    split = expect(obj, "split", str, where)
    step = expect(obj, "step", (int, type(None)), where, required=False)
    kept_fp = expect(obj, "sample_fingerprint", str, where)
    if sample not in (*SAMPLES, "given"):
        raise UserError(f"{where}: field 'sample' must be one of {', '.join(SAMPLES)}, given; got {shown(sample, 40)}")
    if seq_len <= 0 or split_windows < 0 or len(data_fp) > 64:
        raise UserError(f"{where}: seq_len, split_windows or data_fingerprint out of range")
    n = len(expect(obj, "window_ids", list, where))
    if not 0 < n <= MAX_WINDOWS:
        raise UserError(f"{where}: {n} windows (expected 1 to {MAX_WINDOWS:,})")
    ids = _column(obj, "window_ids", int, n, where)
    if (np.diff(ids) <= 0).any() or int(ids[-1]) >= split_windows:
        raise UserError(f"{where}: window_ids must ascend, each below split_windows={split_windows}")
    losses = WindowLosses(data_fp, seq_len, sample, split_windows, ids, _column(obj, "nats", NUMBER, n, where),
                          _column(obj, "bytes", int, n, where), _column(obj, "tokens", int, n, where), step, split)
    if losses.fingerprint != kept_fp:
        raise UserError(f"{where}: sample_fingerprint does not match its data fingerprint, seq_len and window ids")
    return losses
