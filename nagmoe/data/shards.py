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

Crash safety: every file is written under a fresh temporary name and renamed (nagmoe.base.files; committed
shards are hard links to the staged ones until index.json is written, so a failed commit can be re-run); shard
names carry the first 12 hex digits of their sha256, so committing new shards never overwrites a shard the old
index.json refers to (unless its content is identical); index.json is replaced last; only then are shards no index
refers to deleted. A failure at any point leaves the previous preparation readable.

Trust (issue 40): index.json and part.json may come from someone else, so they are schemas (`check_index`): every
field the code uses is type-checked before use, each shard `file` must be a name this writer produces (so no
`../x`, `/abs/x`, `sub/x`), `dtype` must be the one `vocab_size` implies (unsigned: no negative ids, no NaN).
Shards are opened without following a symlink, sized against the record, hashed and range-checked
(`0 <= id < vocab_size`) through the same descriptor that is then memory-mapped (`open_shard`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from typing import Optional

import numpy as np

from nagmoe.data.tokenizer import read_tokenizer_bytes, token_dtype
from nagmoe.base.errors import UserError
from nagmoe.base.files import create_fresh, atomic_writer, temp_name, write_atomic

FORMAT = "nagmoe-tokens-v1"
SPLITS = ("train", "val")
INDEX = "index.json"
PART_INDEX = "part.json"
TOKENIZER = "tokenizer.json"
# the names ShardWriter and merge_parts write (ASCII digits; fullmatch, so no trailing newline either)
SHARD_NAME = re.compile(r"(train|val)-[0-9]{5}-[0-9a-f]{12}\.bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def write_json_atomic(path: str, obj) -> None:
    with atomic_writer(path, durable=True) as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def write_part_index(folder: str, writers: dict, *, vocab_size: int, bos_id: int, tokenizer_sha256: str,
                     corpus: str, documents: str, val_fraction: float, text_field: str,
                     slice_index: Optional[int] = None, num_slices: Optional[int] = None) -> dict:
    """Close one part's ShardWriters (one per split) and write its part.json: the one builder of the part schema
    that `check_index(part=True)` reads back strictly (issue 40), for `prepare-data` and the tools' synthetic
    data alike. `slice_index`/`num_slices`: the slice of the corpus a prepare-data part holds. Returns the dict."""
    records = [r for s in SPLITS for r in writers[s].close()]
    dtype = writers[SPLITS[0]].dtype
    part = {"format": FORMAT, **({"slice": slice_index, "num_slices": num_slices} if slice_index is not None else {}),
            "vocab_size": vocab_size, "dtype": dtype.name, "bos_id": bos_id, "tokenizer_sha256": tokenizer_sha256,
            "corpus": corpus, "documents": documents, "val_fraction": val_fraction, "text_field": text_field,
            "totals": {s: {"n_tokens": writers[s].n_tokens, "n_documents": writers[s].n_documents} for s in SPLITS},
            "shards": records}
    write_json_atomic(os.path.join(folder, PART_INDEX), part)
    return part


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
        raise UserError(f"{path}: unreadable {what} ({str(e)[:120]})") from None


# ----------------------------------------------------------------------------------------------------------
# Index schema (index.json and part.json)
# ----------------------------------------------------------------------------------------------------------
def show(value, limit: int = 60) -> str:
    """A value echoed in a message: its repr, cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int(obj: dict, key: str, where: str, lo: int = 0, hi: Optional[int] = None) -> int:
    """obj[key] as an integer in [lo, hi) (a JSON true is not an integer here)."""
    v = obj.get(key)
    if type(v) is not int:
        raise UserError(f"{where}: '{key}' must be an integer, got {show(v)}" if key in obj else
                        f"{where}: no '{key}'")
    if v < lo or (hi is not None and v >= hi):
        raise UserError(f"{where}: '{key}' = {show(v)} must be >= {lo}" + ("" if hi is None else f" and < {hi}"))
    return v


def _obj(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(v).__name__}")
    return v


def check_index(obj, path: str, part: bool = False) -> dict:
    """`obj` (read from index.json, or part.json when `part`) checked field by field; a UserError names the file
    and the field. Returns `obj`."""
    _obj(obj, path)
    if obj.get("format") != FORMAT:
        raise UserError(f"{path}: unknown format {show(obj.get('format'))} (expected {FORMAT})")
    vocab = _int(obj, "vocab_size", path, 1, (1 << 32) + 1)
    dtype = token_dtype(vocab).name
    if obj.get("dtype") != dtype:
        raise UserError(f"{path}: 'dtype' {show(obj.get('dtype'))} is not {dtype!r}, the dtype of vocab_size {vocab}")
    _int(obj, "bos_id", path, 0, vocab)
    if not isinstance(obj.get("tokenizer_sha256"), str) or not _SHA256.fullmatch(obj["tokenizer_sha256"]):
        raise UserError(f"{path}: 'tokenizer_sha256' must be 64 hex digits, got {show(obj.get('tokenizer_sha256'))}")
    if part:
        for key in ("corpus", "documents", "text_field"):
            if not isinstance(obj.get(key), str):
                raise UserError(f"{path}: '{key}' must be a string, got {show(obj.get(key))}")
        vf = obj.get("val_fraction")
        if type(vf) not in (int, float):
            raise UserError(f"{path}: 'val_fraction' must be a number, got {show(vf)}")
    elif obj.get("tokenizer") != TOKENIZER:  # the data dir's own tokenizer, never another path
        raise UserError(f"{path}: 'tokenizer' must be {TOKENIZER!r}, got {show(obj.get('tokenizer'))}")
    totals = _obj(obj.get("totals"), f"{path}: 'totals'")
    for s in SPLITS:
        t = _obj(totals.get(s), f"{path}: 'totals.{s}'")
        for key in ("n_tokens", "n_documents") + (("n_shards",) if "n_shards" in t else ()):
            _int(t, key, f"{path}: totals.{s}")
    records = obj.get("shards")
    if not isinstance(records, list):
        raise UserError(f"{path}: 'shards' must be a list, got {show(records)}" if "shards" in obj else
                        f"{path}: no 'shards'")
    for i, rec in enumerate(records):
        where = f"{path}: shards[{i}]"
        _obj(rec, where)
        name = rec.get("file")
        if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
            raise UserError(f"{where}.file {show(name)} is not a shard name of this format "
                            "(train|val-NNNNN-<12 hex>.bin, inside the folder)")
        if rec.get("split") not in SPLITS or not name.startswith(f"{rec['split']}-"):
            raise UserError(f"{where}.split {show(rec.get('split'))} is not the split of {name} ({'/'.join(SPLITS)})")
        if rec.get("dtype") != dtype:
            raise UserError(f"{where}.dtype {show(rec.get('dtype'))} is not {dtype!r}, the dtype of vocab_size {vocab}")
        _int(rec, "n_tokens", where)
        _int(rec, "n_documents", where)
        if not isinstance(rec.get("sha256"), str) or not _SHA256.fullmatch(rec["sha256"]):
            raise UserError(f"{where}.sha256 must be 64 hex digits, got {show(rec.get('sha256'))}")
    return obj


def _fresh_file(path: str):
    fd, tmp = create_fresh(path, 0o666)
    return os.fdopen(fd, "wb"), tmp


class ShardWriter:
    """Appends documents of one split to shards of `shard_tokens` ids, hashing while it writes."""

    def __init__(self, out_dir: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, np.dtype(dtype), shard_tokens
        self.records: list[dict] = []
        self.n_tokens = 0
        self.n_documents = 0
        self._file = None

    def _open(self):
        # a fresh O_EXCL|O_NOFOLLOW temporary (nagmoe.base.files): the name is known only once the hash is
        self._file, self._tmp = _fresh_file(os.path.join(self.out_dir, f"{self.split}-{len(self.records):05d}.bin"))
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
def _open_regular(path: str) -> int:
    """A read descriptor on `path` itself: a symlink, a FIFO or a device there is a UserError naming it."""
    try:
        fd = os.open(path, _READ)
    except FileNotFoundError:
        raise UserError(f"missing token shard: {path}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path}: token shard is a symbolic link; nagmoe reads only the files it wrote") from None
        raise UserError(f"{path}: unreadable token shard ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: token shard is not a regular file")
    return fd


def _check_contents(f, path: str, record: dict, vocab: int, chunk: int = 1 << 22) -> None:
    """sha256 and the id range in one pass (the range costs a fraction of the hash)."""
    h, dtype, top = hashlib.sha256(), np.dtype(record["dtype"]), 0
    while block := f.read(chunk):  # chunk is a multiple of the item size; the size was checked
        h.update(block)
        top = max(top, int(np.frombuffer(block, dtype).max()))
    if h.hexdigest() != record["sha256"]:
        raise UserError(f"token shard has a wrong checksum: {path} (re-run nagmoe prepare-data)")
    if top >= vocab:  # unsigned dtypes (check_index): no id is below 0
        raise UserError(id_error(path, top, vocab))


def id_error(path: str, token: int, vocab: int) -> str:
    return (f"{path}: token id {token} >= vocab_size {vocab} of {INDEX} (shard written with another tokenizer, "
            "or corrupted; re-run prepare-data)") if token >= 0 else \
        f"{path}: token id {token} < 0 (corrupted shard; re-run prepare-data)"


def open_shard(path: str, record: dict, vocab: int, checksum: bool = True) -> tuple[np.ndarray, os.stat_result]:
    """The shard at `path` (a record of a checked index), memory-mapped read-only, and its stat: the file itself
    (never through a symlink), its size always, its sha256 and ids `< vocab` when `checksum`, all through one
    descriptor. A wrong file is a UserError naming it."""
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        expected = record["n_tokens"] * np.dtype(record["dtype"]).itemsize
        if st.st_size != expected:
            raise UserError(f"token shard has the wrong size: {path} ({st.st_size} bytes, index says {expected})")
        if checksum:
            _check_contents(f, path, record, vocab)
        if not expected:  # mmap refuses an empty file
            return np.empty(0, dtype=record["dtype"]), st
        return np.memmap(f, dtype=record["dtype"], mode="r"), st


def verify_shard(path: str, record: dict, vocab: int, checksum: bool = True) -> os.stat_result:
    """`open_shard` without keeping the map: its stat (the inode merge_parts then links)."""
    return open_shard(path, record, vocab, checksum)[1]


def read_index(data_dir: str) -> dict:
    path = os.path.join(data_dir, INDEX)
    if not os.path.isfile(path):
        raise UserError(f"no prepared data: {path} not found (run nagmoe prepare-data)")
    return check_index(read_json(path, "token index"), path)


def split_records(index: dict, split: str, where: str = "index.json") -> list[dict]:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (use {' or '.join(SPLITS)})")
    records = [r for r in index["shards"] if r["split"] == split]
    if not records:
        raise UserError(f"{where}: the {split} split has no shards")
    return records


def open_split(data_dir: str, split: str, verify: bool = True,
               index: Optional[dict] = None) -> tuple[dict, list[dict], list[np.ndarray]]:
    """(index, records, arrays) of one split: every reader of shards (loader, unigram baseline) opens them here.
    The joins are safe: check_index allows only this writer's plain file names."""
    index = read_index(data_dir) if index is None else index
    records = split_records(index, split, os.path.join(data_dir, INDEX))
    arrays = [open_shard(os.path.join(data_dir, r["file"]), r, index["vocab_size"], verify)[0] for r in records]
    return index, records, arrays


# ----------------------------------------------------------------------------------------------------------
# Parts and merge
# ----------------------------------------------------------------------------------------------------------
def part_dir_name(slice_index: int, num_slices: int) -> str:
    return f"part-{slice_index:05d}-of-{num_slices:05d}"


def find_parts(stage_dir: str, num_slices: Optional[int]) -> tuple[int, list[str]]:
    """The complete set of part folders (in slice order); any gap is a UserError naming the missing part."""
    pattern = re.compile(r"part-([0-9]{5})-of-([0-9]{5})")
    found = {}
    if os.path.isdir(stage_dir):
        for name in os.listdir(stage_dir):
            m = pattern.fullmatch(name)
            if m and os.path.islink(os.path.join(stage_dir, name)):  # the writer renames a real folder there
                raise UserError(f"{os.path.join(stage_dir, name)}: a part folder is a symbolic link; re-run that slice")
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
    parts = [check_index(read_json(os.path.join(d, PART_INDEX), "part index"), os.path.join(d, PART_INDEX), part=True)
             for d in part_dirs]
    for d, p in zip(part_dirs, parts):
        for key in _SHARED_KEYS:
            if p.get(key) != parts[0].get(key):
                raise UserError(f"{os.path.join(d, PART_INDEX)}: {key}={show(p.get(key))} differs from part 0's "
                                f"{show(parts[0].get(key))}; re-run that slice")
    tokenizer = read_tokenizer_bytes(tokenizer_path)  # read once: the bytes hashed are the bytes copied
    if hashlib.sha256(tokenizer).hexdigest() != parts[0]["tokenizer_sha256"]:
        raise UserError(f"{tokenizer_path}: not the tokenizer the parts were made with (sha256 differs)")
    vocab = parts[0]["vocab_size"]
    stats = [[verify_shard(os.path.join(d, rec["file"]), rec, vocab, checksum=verify) for rec in p["shards"]]
             for d, p in zip(part_dirs, parts)]
    totals = {s: {"n_tokens": sum(p["totals"][s]["n_tokens"] for p in parts),
                  "n_documents": sum(p["totals"][s]["n_documents"] for p in parts)} for s in SPLITS}
    if totals["train"]["n_documents"] == 0 and totals["val"]["n_documents"] == 0:
        raise UserError(f"empty corpus: no text in data.corpus={_cut(parts[0]['corpus'])}")
    for s in SPLITS:
        if totals[s]["n_documents"] == 0:
            n = totals["train"]["n_documents"] + totals["val"]["n_documents"]
            raise UserError(f"the {s} split is empty ({n} documents in data.corpus={_cut(parts[0]['corpus'])}, "
                            f"data.val_fraction={parts[0]['val_fraction']}); use more text or change val_fraction")

    os.makedirs(data_dir, exist_ok=True)
    committed = []
    for s in SPLITS:
        k = 0
        for d, p, st in zip(part_dirs, parts, stats):
            for rec, rec_st in ((r, t) for r, t in zip(p["shards"], st) if r["split"] == s):
                name = f"{s}-{k:05d}-{rec['sha256'][:12]}.bin"
                _place(os.path.join(d, rec["file"]), os.path.join(data_dir, name), rec_st)
                committed.append({**rec, "file": name})
                k += 1
        totals[s]["n_shards"] = k
    final_tok = os.path.join(data_dir, TOKENIZER)
    if os.path.abspath(tokenizer_path) != os.path.abspath(final_tok):
        write_atomic(final_tok, tokenizer, durable=True)
    index = {key: parts[0][key] for key in _SHARED_KEYS}
    index.update(tokenizer=TOKENIZER, totals=totals, shards=committed)
    write_json_atomic(os.path.join(data_dir, INDEX), index)
    remove_unreferenced_shards(data_dir, index)
    return index


# link(2) errors meaning "no hard link from there to here": another file system (EXDEV, e.g. parts/ a symlink to
# scratch), or one without hard links (ENOTSUP/EOPNOTSUPP, and EPERM, which also answers fs.protected_hardlinks for
# another user's file: hence the ownership check before anything is moved)
_NO_LINKS = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP}


def _place(src: str, dst: str, verified: os.stat_result) -> None:
    """Put the verified shard `src` at dst atomically, keeping src (a hard link) so a failed commit can be re-run
    from the parts. Only the inode that was verified is placed (a regular file, never a symlink: verify_shard
    opened it with O_NOFOLLOW). Where no hard link can be made it is moved instead (renamed, or copied across file
    systems), and only if it is a file this user's preparation wrote: owned by us, with no other name."""
    same = (verified.st_dev, verified.st_ino)
    where = os.path.dirname(dst) or "."
    tmp = temp_name(dst)
    try:
        os.link(src, tmp, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise UserError(f"{src}: cannot link it into {where} ({e.strerror})") from None
        st = os.lstat(src)
        if ((st.st_dev, st.st_ino) != same or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1
                or st.st_uid != os.geteuid()):
            raise UserError(f"{src}: cannot link it into {where} ({e.strerror}), and it is not a file this "
                            "preparation wrote (owned by you, with one name), so it is not moved") from None
        try:
            os.replace(src, dst)
        except OSError as e2:
            if e2.errno != errno.EXDEV:
                raise UserError(f"{src}: cannot move it into {where} ({e2.strerror})") from None
            _copy_verified(src, dst, same)
        return
    st = os.lstat(tmp)
    if (st.st_dev, st.st_ino) != same:  # src was swapped after it was verified
        os.unlink(tmp)
        raise UserError(f"{src}: changed while it was merged; re-run nagmoe prepare-data --merge")
    os.replace(tmp, dst)


def _copy_verified(src: str, dst: str, same: tuple) -> None:
    """src (the verified inode, else a UserError) copied to dst through a fresh temporary (another file system)."""
    fd = _open_regular(src)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != same:
            raise UserError(f"{src}: changed while it was merged; re-run nagmoe prepare-data --merge")
        with atomic_writer(dst, binary=True, durable=True) as out:
            shutil.copyfileobj(f, out, 1 << 22)


def remove_unreferenced_shards(data_dir: str, index: dict) -> None:
    keep = {r["file"] for r in index["shards"]}
    for name in os.listdir(data_dir):
        if SHARD_NAME.fullmatch(name) and name not in keep:
            os.remove(os.path.join(data_dir, name))
