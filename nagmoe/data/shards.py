"""Packed token shards on disk: format, writer, part indexes, merge/commit, verified opening.

Layout of a prepared `data.data_dir`:
    tokenizer.json
    index.json                       the only file readers trust (written last, atomically)
    train-00000-<sha12>.bin ...      raw token ids, no header: np.memmap(path, dtype=index dtype, mode="r")
    val-00000-<sha12>.bin ...
    parts/                           staging of sharded preparation (gone after --merge)

Packing. A split is ONE stream of documents: each document is `[BOS] + ids(text)`, concatenated with no
padding and no EOS, in corpus order, cut into shards of `data.shard_tokens` ids (a document may continue in
the next shard). Ids are uint16 when the vocabulary has <= 65536 entries, else uint32 (little-endian).
A training row is a window of `seq_len + 1` consecutive ids of one shard starting at a multiple of
`seq_len`: x = w[:-1], y = w[1:], so every id after a shard's first is a target exactly once per epoch;
windows do not cross shard ends (each shard's < seq_len tail ids are never targets).

index.json: {"format", "vocab_size", "dtype", "bos_id", "tokenizer": "tokenizer.json", "tokenizer_sha256",
"corpus", "documents", "val_fraction", "totals": {split: {"n_tokens", "n_documents", "n_shards"}},
"shards": [{"file", "split", "dtype", "n_tokens", "n_documents", "sha256"}, ...]} (shards in stream order).

Crash safety: every file is written under a temporary name and renamed (committed shards are hard links
to the staged ones until index.json is written, so a failed commit can be re-run); shard names carry the
first 12 hex digits of their sha256, so committing new shards never overwrites a shard the old index.json refers to
(unless its content is identical); index.json is replaced last; only then are shards no index refers to
deleted. A failure at any point leaves the previous preparation readable.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Optional

import numpy as np

from nagmoe.errors import UserError

FORMAT = "nagmoe-tokens-v1"
SPLITS = ("train", "val")
INDEX = "index.json"
PART_INDEX = "part.json"
SHARD_NAME = re.compile(r"^(train|val)-\d{5}-[0-9a-f]{12}\.bin$")


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable {what} ({e})") from None


class ShardWriter:
    """Appends documents of one split to shards of `shard_tokens` ids, hashing while it writes."""

    def __init__(self, out_dir: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, np.dtype(dtype), shard_tokens
        self.records: list[dict] = []
        self.n_tokens = 0
        self.n_documents = 0
        self._file = None

    def _open(self):
        self._tmp = os.path.join(self.out_dir, f"{self.split}-{len(self.records):05d}.bin.tmp")
        self._file = open(self._tmp, "wb")
        self._sha = hashlib.sha256()
        self._in_shard = 0
        self._docs_in_shard = 0

    def _close_shard(self):
        self._file.close()
        sha = self._sha.hexdigest()
        name = f"{self.split}-{len(self.records):05d}-{sha[:12]}.bin"
        os.replace(self._tmp, os.path.join(self.out_dir, name))
        self.records.append({"file": name, "split": self.split, "dtype": self.dtype.name,
                             "n_tokens": self._in_shard, "n_documents": self._docs_in_shard, "sha256": sha})
        self._file = None

    def add_document(self, ids: np.ndarray) -> None:
        """`ids` already starts with BOS. `n_documents` of a shard counts the documents that start in it."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        self.n_documents += 1
        starts_here = True
        while len(ids):
            if self._file is None:
                self._open()
            take = min(len(ids), self.shard_tokens - self._in_shard)
            chunk = ids[:take].tobytes()
            self._file.write(chunk)
            self._sha.update(chunk)
            self._in_shard += take
            self._docs_in_shard += starts_here
            starts_here = False
            self.n_tokens += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.records


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------
def verify_shard(path: str, record: dict, checksum: bool = True) -> None:
    """Size always; sha256 when `checksum`. A wrong file is a UserError naming it."""
    if not os.path.isfile(path):
        raise UserError(f"missing token shard: {path}")
    expected = record["n_tokens"] * np.dtype(record["dtype"]).itemsize
    size = os.path.getsize(path)
    if size != expected:
        raise UserError(f"token shard has the wrong size: {path} ({size} bytes, index says {expected})")
    if checksum:
        from nagmoe.data.tokenizer import file_sha256

        if file_sha256(path) != record["sha256"]:
            raise UserError(f"token shard has a wrong checksum: {path} (re-run nagmoe prepare-data)")


def read_index(data_dir: str) -> dict:
    path = os.path.join(data_dir, INDEX)
    if not os.path.isfile(path):
        raise UserError(f"no prepared data: {path} not found (run nagmoe prepare-data)")
    index = read_json(path, "token index")
    if index.get("format") != FORMAT:
        raise UserError(f"{path}: unknown format {index.get('format')!r} (expected {FORMAT})")
    return index


def split_records(index: dict, split: str, where: str = "index.json") -> list[dict]:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (use {' or '.join(SPLITS)})")
    records = [r for r in index["shards"] if r["split"] == split]
    if not records:
        raise UserError(f"{where}: the {split} split has no shards")
    return records


# ----------------------------------------------------------------------------------------------------------
# Parts and merge
# ----------------------------------------------------------------------------------------------------------
def part_dir_name(slice_index: int, num_slices: int) -> str:
    return f"part-{slice_index:05d}-of-{num_slices:05d}"


def find_parts(stage_dir: str, num_slices: Optional[int]) -> tuple[int, list[str]]:
    """The complete set of part folders (in slice order); any gap is a UserError naming the missing part."""
    pattern = re.compile(r"^part-(\d{5})-of-(\d{5})$")
    found = {}
    if os.path.isdir(stage_dir):
        for name in os.listdir(stage_dir):
            m = pattern.match(name)
            if m:
                found.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(stage_dir, name)
    if num_slices is None:
        if len(found) != 1:
            raise UserError(f"{stage_dir}: expected the parts of one slicing, found "
                            f"{sorted(found) or 'none'} (pass --num-shards N)")
        num_slices = next(iter(found))
    parts = found.get(num_slices, {})
    for i in range(num_slices):
        if i not in parts:
            missing = os.path.join(stage_dir, part_dir_name(i, num_slices), PART_INDEX)
            raise UserError(f"missing part {i} of {num_slices}: {missing} (did slice {i} finish?)")
    return num_slices, [parts[i] for i in range(num_slices)]


# keys every part must agree on to be merged
_SHARED_KEYS = ("format", "vocab_size", "dtype", "bos_id", "tokenizer_sha256", "corpus", "documents",
                "val_fraction", "text_field")


def merge_parts(data_dir: str, part_dirs: list[str], tokenizer_path: str, verify: bool = True) -> dict:
    """Check the parts, then commit them into data_dir in slice order (see the module docstring)."""
    from nagmoe.data.tokenizer import file_sha256

    parts = [read_json(os.path.join(d, PART_INDEX), "part index") for d in part_dirs]
    for d, p in zip(part_dirs, parts):
        for key in _SHARED_KEYS:
            if p.get(key) != parts[0].get(key):
                raise UserError(f"{os.path.join(d, PART_INDEX)}: {key}={p.get(key)!r} differs from part 0's "
                                f"{parts[0].get(key)!r}; re-run that slice")
    tok_sha = file_sha256(tokenizer_path)
    if tok_sha != parts[0]["tokenizer_sha256"]:
        raise UserError(f"{tokenizer_path}: not the tokenizer the parts were made with (sha256 differs)")
    for d, p in zip(part_dirs, parts):
        for rec in p["shards"]:
            verify_shard(os.path.join(d, rec["file"]), rec, checksum=verify)
    totals = {s: {"n_tokens": sum(p["totals"][s]["n_tokens"] for p in parts),
                  "n_documents": sum(p["totals"][s]["n_documents"] for p in parts)} for s in SPLITS}
    if totals["train"]["n_documents"] == 0 and totals["val"]["n_documents"] == 0:
        raise UserError(f"empty corpus: no text in data.corpus={parts[0]['corpus']}")
    for s in SPLITS:
        if totals[s]["n_documents"] == 0:
            n = totals["train"]["n_documents"] + totals["val"]["n_documents"]
            raise UserError(f"the {s} split is empty ({n} documents in data.corpus={parts[0]['corpus']}, "
                            f"data.val_fraction={parts[0]['val_fraction']}); use more text or change val_fraction")

    os.makedirs(data_dir, exist_ok=True)
    committed = []
    for s in SPLITS:
        k = 0
        for d, p in zip(part_dirs, parts):
            for rec in (r for r in p["shards"] if r["split"] == s):
                name = f"{s}-{k:05d}-{rec['sha256'][:12]}.bin"
                _place(os.path.join(d, rec["file"]), os.path.join(data_dir, name))
                committed.append({**rec, "file": name})
                k += 1
        totals[s]["n_shards"] = k
    final_tok = os.path.join(data_dir, "tokenizer.json")
    if os.path.abspath(tokenizer_path) != os.path.abspath(final_tok):
        tmp = f"{final_tok}.tmp-{os.getpid()}"
        shutil.copyfile(tokenizer_path, tmp)
        os.replace(tmp, final_tok)
    index = {key: parts[0][key] for key in _SHARED_KEYS}
    index.update(tokenizer="tokenizer.json", totals=totals, shards=committed)
    write_json_atomic(os.path.join(data_dir, INDEX), index)
    remove_unreferenced_shards(data_dir, index)
    return index


def _place(src: str, dst: str) -> None:
    """Put src at dst atomically, keeping src (a hard link) so a failed commit can be re-run from the parts;
    falls back to a rename on file systems without hard links."""
    tmp = f"{dst}.tmp-{os.getpid()}"
    try:
        os.link(src, tmp)
    except OSError:
        os.replace(src, dst)
        return
    os.replace(tmp, dst)


def remove_unreferenced_shards(data_dir: str, index: dict) -> None:
    keep = {r["file"] for r in index["shards"]}
    for name in os.listdir(data_dir):
        if SHARD_NAME.match(name) and name not in keep:
            os.remove(os.path.join(data_dir, name))
