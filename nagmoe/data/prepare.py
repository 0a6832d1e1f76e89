"""`nagmoe prepare-data`: corpus -> tokenizer -> packed token shards (format in `nagmoe.data.shards`).

Single pass (default): train or load the tokenizer, tokenise every document, commit — all staged in a fresh
`data_dir/.prepare-<random>/` and removed afterwards, so a failure leaves the previous preparation intact.

Sharded preparation for corpora too large for one process (a SLURM job array):

    nagmoe prepare-data --config C --tokenizer-only                 # 1 job: data_dir/parts/tokenizer.json
    sbatch --array=0-63 ... nagmoe prepare-data --config C --num-shards 64   # index from SLURM_ARRAY_TASK_ID
    sbatch --dependency=afterok:<array job> ... nagmoe prepare-data --config C --merge

Step 1 is skipped when `data.tokenizer` names an existing tokenizer.json (slices then use it directly).
Slice i of N tokenises a contiguous run of input files (`corpus.slice_range`) into
`data_dir/parts/part-0000i-of-000N/` (written in a fresh temporary folder, renamed when complete, so a re-run
array task replaces only its own part). `--merge` checks that all N parts exist, agree (tokenizer sha,
settings) and match their checksums, then hard-links (without hard links: moves) their shards into place in slice order:
the result equals a single pass token for token. The single pass is literally slice 0 of 1 followed by the merge.
"""
from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections import deque
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from nagmoe.data import shards
from nagmoe.data.corpus import Corpus, check_slicing, is_val_document, iter_documents, resolve_corpus
from nagmoe.data.tokenizer import (bos_id, check_vocab, encode_documents, file_sha256, load_tokenizer,
                                   save_tokenizer, token_dtype, train_bpe)
from nagmoe.base.errors import UserError
from nagmoe.base.files import make_temp_dir

STAGE = "parts"
TOKENIZER_CHARS = 2_000_000_000  # BPE training reads at most this many characters of train documents
DOCS_PER_BATCH = 256


def _progress(iterable, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30.0)


def _remove(path: str) -> None:
    """Whatever is at `path`, without following a symlink there (rmtree refuses one: unlink it)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _check_data_dir(data_dir: str) -> None:
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise UserError(f"data.data_dir: {data_dir} exists and is not a folder")
    os.makedirs(data_dir, exist_ok=True)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer step
# ----------------------------------------------------------------------------------------------------------
def _training_texts(corpus: Corpus, val_fraction: float, max_chars: int, seen: list) -> Iterator[str]:
    """Train-split documents only (the tokenizer never sees validation text), up to max_chars."""
    chars = 0
    with _progress(iter_documents(corpus), "tokenizer: reading", "doc") as docs:
        for doc in docs:
            seen[0] += 1
            if is_val_document(doc, val_fraction):
                continue
            yield doc
            chars += len(doc)
            if chars >= max_chars:
                return


def check_given_tokenizer(cfg) -> str:
    """data.tokenizer: it must load, have a BOS token and model.vocab_size ids."""
    path = cfg.data.tokenizer
    tok = load_tokenizer(path)
    check_vocab(tok, cfg.model.vocab_size, path)
    bos_id(tok, path)
    return path


def train_tokenizer(cfg, out_path: str, max_chars: int = TOKENIZER_CHARS) -> str:
    """Train a byte-level BPE of model.vocab_size ids on the train documents; write it atomically."""
    d = cfg.data
    corpus = resolve_corpus(d.corpus, d.text_field)
    seen = [0]
    texts = _training_texts(corpus, d.val_fraction, max_chars, seen)
    first = next(texts, None)
    if first is None:
        what = corpus.files[0] if len(corpus.files) == 1 else f"data.corpus={d.corpus}"
        raise UserError(f"empty corpus: no text in {what}" if seen[0] == 0 else
                        f"no training text: all {seen[0]} documents of data.corpus={d.corpus} fall in "
                        f"the validation split (data.val_fraction={d.val_fraction})")
    tok = train_bpe(itertools.chain([first], texts), cfg.model.vocab_size, show_progress=sys.stderr.isatty())
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    save_tokenizer(tok, out_path)
    return out_path


# ----------------------------------------------------------------------------------------------------------
# Slice step
# ----------------------------------------------------------------------------------------------------------
def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(it)
    while batch := list(itertools.islice(it, n)):
        yield batch


# Worker processes (num_proc > 1) keep their tokenizer in this per-process dict, set once by the initializer.
_WORKER: dict = {}


def _worker_init(tokenizer_path: str, bos: int, dtype: str) -> None:
    _WORKER.update(tok=load_tokenizer(tokenizer_path), bos=bos, dtype=np.dtype(dtype))


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    return encode_documents(_WORKER["tok"], texts, _WORKER["bos"], _WORKER["dtype"])


def _encoded_batches(batches: Iterator[list[str]], tokenizer_path: str, bos: int, dtype: np.dtype,
                     num_proc: int) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    if num_proc <= 1:
        tok = load_tokenizer(tokenizer_path)
        for texts in batches:
            yield texts, encode_documents(tok, texts, bos, dtype)
        return
    import multiprocessing as mp

    # spawn, not fork: the parent may already run tokenizers' thread pool (forking it is unsafe)
    with mp.get_context("spawn").Pool(num_proc, _worker_init, (tokenizer_path, bos, dtype.name)) as pool:
        in_flight: deque = deque()  # bounded, in order (Pool.imap would read the whole corpus ahead)
        for texts in batches:
            in_flight.append((texts, pool.apply_async(_worker_encode, (texts,))))
            if len(in_flight) >= 2 * num_proc:
                texts, result = in_flight.popleft()
                yield texts, result.get()
        while in_flight:
            texts, result = in_flight.popleft()
            yield texts, result.get()


def prepare_slice(cfg, tokenizer_path: str, stage_dir: str, slice_index: int = 0, num_slices: int = 1) -> str:
    """Tokenise slice i of N into stage_dir/part-i-of-N/ (part.json + shards); returns that folder."""
    d = cfg.data
    corpus = resolve_corpus(d.corpus, d.text_field)
    check_slicing(corpus, slice_index, num_slices)
    tok = load_tokenizer(tokenizer_path)
    check_vocab(tok, cfg.model.vocab_size, tokenizer_path)
    bos = bos_id(tok, tokenizer_path)
    dtype = token_dtype(cfg.model.vocab_size)
    final = os.path.join(stage_dir, shards.part_dir_name(slice_index, num_slices))
    os.makedirs(stage_dir, exist_ok=True)
    tmp = make_temp_dir(stage_dir, f".{os.path.basename(final)}.tmp-")  # fresh, ours: nothing planted inside
    try:
        writers = {s: shards.ShardWriter(tmp, s, dtype, d.shard_tokens) for s in shards.SPLITS}
        with _progress(iter_documents(corpus, slice_index, num_slices),
                       f"tokenising slice {slice_index}/{num_slices}", "doc") as docs:
            for texts, encoded in _encoded_batches(_batched(docs, DOCS_PER_BATCH), tokenizer_path, bos, dtype,
                                                   d.num_proc):
                for text, ids in zip(texts, encoded):
                    writers["val" if is_val_document(text, d.val_fraction) else "train"].add_document(ids)
        shards.write_part_index(tmp, writers, vocab_size=cfg.model.vocab_size, bos_id=bos,
                                tokenizer_sha256=file_sha256(tokenizer_path), corpus=d.corpus,
                                documents=corpus.describe_documents(), val_fraction=d.val_fraction,
                                text_field=d.text_field, slice_index=slice_index, num_slices=num_slices)
        _remove(final)  # an earlier run of this same slice (a link planted there is removed, not followed)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------
# Entry points used by the command
# ----------------------------------------------------------------------------------------------------------
def stage_tokenizer_path(cfg) -> str:
    return cfg.data.tokenizer or os.path.join(cfg.data.data_dir, STAGE, "tokenizer.json")


def prepare_single(cfg, max_chars: int = TOKENIZER_CHARS) -> dict:
    _check_data_dir(cfg.data.data_dir)
    stage = make_temp_dir(cfg.data.data_dir, ".prepare-")  # fresh, ours (a planted `.prepare-<pid>` is not)
    try:
        if cfg.data.tokenizer:
            tok_path = check_given_tokenizer(cfg)
        else:
            tok_path = train_tokenizer(cfg, os.path.join(stage, "tokenizer.json"), max_chars)
        part = prepare_slice(cfg, tok_path, stage, 0, 1)
        return shards.merge_parts(cfg.data.data_dir, [part], tok_path, verify=False)  # just written
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ensure_prepared(cfg, log: Optional[Callable[[str], None]] = None) -> str:
    """`prepare_single(cfg)` unless `data.data_dir` already holds a prepared index; returns the data dir. `log`
    hears one line before a preparation starts."""
    if not os.path.isfile(os.path.join(cfg.data.data_dir, shards.INDEX)):
        if log is not None:
            log(f"preparing {cfg.data.corpus} into {cfg.data.data_dir}")
        prepare_single(cfg)
    return cfg.data.data_dir


def prepare_tokenizer_only(cfg, max_chars: int = TOKENIZER_CHARS) -> str:
    """Step 1 of sharded preparation; with data.tokenizer set it only checks that tokenizer."""
    _check_data_dir(cfg.data.data_dir)
    if cfg.data.tokenizer:
        return check_given_tokenizer(cfg)
    return train_tokenizer(cfg, stage_tokenizer_path(cfg), max_chars)


def prepare_part(cfg, slice_index: int, num_slices: int) -> str:
    _check_data_dir(cfg.data.data_dir)
    tok_path = stage_tokenizer_path(cfg)
    if not os.path.isfile(tok_path):
        raise UserError(f"no tokenizer for sharded preparation: {tok_path} not found; run "
                        "`nagmoe prepare-data --config ... --tokenizer-only` first (or set data.tokenizer)")
    return prepare_slice(cfg, tok_path, os.path.join(cfg.data.data_dir, STAGE), slice_index, num_slices)


def prepare_merge(cfg, num_slices: Optional[int] = None) -> dict:
    stage = os.path.join(cfg.data.data_dir, STAGE)
    _, part_dirs = shards.find_parts(stage, num_slices)
    index = shards.merge_parts(cfg.data.data_dir, part_dirs, stage_tokenizer_path(cfg), verify=True)
    shutil.rmtree(stage, ignore_errors=True)
    return index
