"""Tokenizer: train a byte-level BPE with HF `tokenizers`, or load an existing `tokenizer.json`.

The trained tokenizer is GPT-2 style byte-level BPE (regex pre-split, no prefix space, byte-level decoder),
so `decode(encode(text)) == text` for any UTF-8 text. Its only special token is `<|bos|>` with id 0; it
precedes every document in the token stream. A loaded tokenizer may use another BOS spelling from
`BOS_CANDIDATES`. Documents are encoded with `encode_special_tokens=True`, so a literal "<|bos|>" inside a
text is ordinary text and can never inject a BOS id.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable

import numpy as np

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import write_atomic

BOS = "<|bos|>"
BOS_CANDIDATES = (BOS, "<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>")
MIN_BYTE_LEVEL_VOCAB = 257  # 256 byte symbols + <|bos|>
MAX_TOKENIZER_BYTES = 64 << 20  # a 256k-token BPE is ~20 MB; config.json's cap is 1 MiB


def file_sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = True):
    """Byte-level BPE with exactly `vocab_size` ids (<|bos|> = 0), or a UserError if the text is too small."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BYTE_LEVEL_VOCAB:
        raise UserError(f"model.vocab_size: {vocab_size} is below {MIN_BYTE_LEVEL_VOCAB} "
                        "(256 byte symbols + <|bos|>) for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise UserError(f"the corpus is too small to train a {vocab_size}-token BPE (it yields {got} tokens); "
                        "lower model.vocab_size or use a larger data.corpus")
    return tok


def load_tokenizer(path: str):
    """The tokenizer at `path`, through the one bounded reader (read_tokenizer_bytes + tokenizer_from_bytes)."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer not found: {shown(path)}")
    return tokenizer_from_bytes(read_tokenizer_bytes(path), path)


def _check_size(size: int, path: str) -> None:
    if size > MAX_TOKENIZER_BYTES:
        raise UserError(f"{shown(path)}: {size:,} bytes is too large for a tokenizer.json (at most "
                        f"{MAX_TOKENIZER_BYTES:,})")


def read_tokenizer_bytes(path: str) -> bytes:
    """The file's bytes, read once (a caller hashes and loads the same bytes: no swap in between), at most
    MAX_TOKENIZER_BYTES (checked on the open file, and the read bounded: a file growing meanwhile is refused too)."""
    try:
        with open(path, "rb") as f:
            _check_size(os.fstat(f.fileno()).st_size, path)
            data = f.read(MAX_TOKENIZER_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"tokenizer not found: {shown(path)}") from None
    except OSError as e:
        raise UserError(f"{shown(path)}: unreadable tokenizer ({e.strerror})") from None
    _check_size(len(data), path)
    return data


def tokenizer_from_bytes(data: bytes, path: str):
    """A tokenizer from the bytes of `path` (named in errors)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # UnicodeDecodeError, or tokenizers' bare Exception for malformed JSON
        raise UserError(f"{shown(path)}: not a valid tokenizer.json ({(str(e).splitlines() or [''])[0][:160]})") \
            from None


def save_tokenizer(tok, path: str) -> None:
    """Atomic and through a fresh temporary (nagmoe.base.files): the bytes `tok.save(path)` writes."""
    write_atomic(path, tok.to_str(pretty=True), durable=True)


def vocab_size_of(tok) -> int:
    return tok.get_vocab_size(with_added_tokens=True)


def check_vocab(tok, vocab_size: int, path: str) -> None:
    got = vocab_size_of(tok)
    if got != vocab_size:
        raise UserError(f"tokenizer/model vocab mismatch: {shown(path)} has {got} tokens, model.vocab_size={vocab_size}")


def bos_id(tok, path: str) -> int:
    for name in BOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise UserError(f"{shown(path)}: no BOS token (looked for {', '.join(BOS_CANDIDATES)})")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_documents(tok, texts: list[str], bos: int, dtype: np.dtype) -> list[np.ndarray]:
    """Each document as [BOS] + its token ids, in the shard dtype."""
    tok.encode_special_tokens = True
    out = []
    for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
        ids = np.empty(len(enc.ids) + 1, dtype=dtype)
        ids[0] = bos
        ids[1:] = enc.ids
        out.append(ids)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by the ByteLevel pre-tokenizer:
    printable Latin-1 bytes map to themselves, the other 68 bytes to chr(256 + n) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, n = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (int64, shape (V,)); special tokens count 0 bytes.

    Byte-level tokenizers: exact, by inverting the byte -> character map. Other tokenizers: the length of
    `decode([id])`, an approximation for pieces that are not whole characters.
    """
    import json

    decoder = json.loads(tok.to_str()).get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out = np.zeros(vocab_size_of(tok), dtype=np.int64)
    for i in range(len(out)):
        piece = tok.id_to_token(i)
        if piece is None or piece in special:
            continue
        if byte_level and all(c in char_to_byte for c in piece):
            out[i] = len(piece)
        else:
            out[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out
