"""The on-disk layout every checkpoint shares, whatever the engine, and its verification.

    RUN_DIR/checkpoints/step_000123/
        ...engine files...     DCP files (torch engine) or DeepSpeed's files + own_rank_*.pt (deepspeed)
        state.json             {"format", "step", "rng": [per rank], "extra": ..., ["layout"]}
        manifest.json          sha256 and size of every other file; written last

A reader takes a checkpoint only if its manifest exists and every listed file has the recorded size and
sha256, so a half-written, truncated or corrupted checkpoint is never loaded. `step_N.tmp-<tag>` is a save
in progress (or one killed before it published); `step_N.del-<tag>` is a checkpoint being deleted.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import expect, expect_object, loads_json, read_json, read_text, write_atomic
from nagmoe.rundir.names import CHECKPOINTS

MANIFEST = "manifest.json"
STATE = "state.json"
DCP_METADATA = ".metadata"  # DCP's own index, written by the saving group's coordinator
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^step_(\d+)\.tmp-")  # a save in progress, or one killed before it published
_HASH_CHUNK = 1 << 22


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def write_json(path: str, obj: Any) -> None:
    """Durably, through the safe writer (nagmoe.base.files): a fresh temporary, fsynced, renamed."""
    text = json.dumps(obj, indent=1, allow_nan=False)  # a ValueError before anything is created
    write_atomic(path, text, durable=True)


def sha256_and_sync(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


def hash_threads() -> int:
    """Files are hashed in parallel: sha256 and file reads release the GIL, so threads use the cores and
    the file system's parallelism (one core hashes ~1.3 GB/s: docs/benchmarks.md)."""
    return max(1, min(8, os.cpu_count() or 1))


def parallel_map(fn: Callable, items: list) -> list:
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        return list(pool.map(fn, items))


def describe_files(root: str, known: Optional[dict] = None) -> dict:
    """{relative path: {"sha256", "bytes"}} of every file under `root`, hashed (and fsync'ed) in parallel.
    `known`: entries the ranks that wrote those files hashed themselves (`own_digests`, issue 68); each is taken
    after a stat confirms its size (a file changed since would fail every load's verification anyway), and only
    the files it does not list are hashed here. An entry whose file is gone is a FileNotFoundError: the save
    is incomplete and must not be published."""
    known = known or {}
    rels = files_under(root)
    missing = sorted(set(known) - set(rels))
    if missing:
        raise FileNotFoundError(errno.ENOENT, "a file its writer hashed is gone", os.path.join(root, missing[0]))

    def entry(rel: str) -> dict:
        path = os.path.join(root, rel)
        if rel in known and os.path.getsize(path) == known[rel]["bytes"]:
            return known[rel]
        return {"sha256": sha256_and_sync(path), "bytes": os.path.getsize(path)}

    hashed = [rel for rel in rels if rel not in known]
    out = dict(zip(hashed, parallel_map(entry, hashed)))
    out.update({rel: entry(rel) for rel in rels if rel in known})
    return dict(sorted(out.items()))


def own_files(root: str, rank: int) -> list[str]:
    """The files DCP's FileSystemWriter wrote for `rank` of the saving group under `root` (`__<rank>_<n>.distcp`),
    and the coordinator's (rank 0) `.metadata`: what that rank hashes itself."""
    prefix = f"__{rank}_"
    return sorted(name for name in os.listdir(root) if (name.startswith(prefix) and name.endswith(".distcp"))
                  or (rank == 0 and name == DCP_METADATA))


def own_digests(root: str, rank: int) -> dict:
    """{relative path: {"sha256", "bytes"}} of this rank's own files (`own_files`), hashed and fsync'ed in
    parallel on the rank that wrote them (its page cache, its node: no other rank re-reads them)."""
    rels = own_files(root, rank)
    return dict(zip(rels, parallel_map(
        lambda rel: {"sha256": sha256_and_sync(os.path.join(root, rel)),
                     "bytes": os.path.getsize(os.path.join(root, rel))}, rels)))


def files_under(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def step_dirs(root: str, pattern: re.Pattern = STEP_DIR) -> list[tuple[int, str]]:
    """(step, path) of the directories under `root` whose name matches `pattern` (default: a published step_N),
    oldest first; none when `root` does not exist."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = pattern.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Published checkpoint directories (valid or not), oldest first; tmp/del directories are ignored."""
    return step_dirs(os.path.join(run_dir, CHECKPOINTS))


def unfinished_writes(run_dir: str) -> list[tuple[int, str]]:
    """Temporary directories of saves that never published (the process died mid-write), oldest first."""
    return step_dirs(os.path.join(run_dir, CHECKPOINTS), TMP_DIR)


def verify_checkpoint(path: str) -> dict:
    """Check the manifest of checkpoint `path`; return it, or raise UserError naming the bad file."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path} does not exist or is not a directory")
    if not os.path.isfile(manifest_path):
        raise UserError(f"checkpoint {path} has no {MANIFEST} (incomplete checkpoint)")
    where = f"checkpoint manifest {shown(manifest_path)}"
    manifest = expect_object(loads_json(read_text(manifest_path), f"{where} is unreadable"), where)
    files = expect(manifest, "files", dict, where)
    if STATE not in files:
        raise UserError(f"checkpoint manifest {manifest_path} does not list {STATE}")
    for rel, entry in files.items():  # the schema first: every entry {"sha256": str, "bytes": int}
        expect(expect_object(entry, f"{where} files[{shown(rel)}]"), "sha256", str, f"{where} files[{shown(rel)}]")
        expect(entry, "bytes", int, f"{where} files[{shown(rel)}]")
    for rel, entry in files.items():  # cheap checks first: a missing or truncated file needs no hashing
        file_path = os.path.join(path, rel)
        if os.path.isabs(rel) or ".." in rel.split("/") or not os.path.isfile(file_path):
            raise UserError(f"checkpoint file {file_path} is missing")
        try:
            size = os.path.getsize(file_path)
        except FileNotFoundError:  # gone since the check above (another writer renamed the directory)
            raise UserError(f"checkpoint file {file_path} is missing") from None
        if size != entry["bytes"]:
            raise UserError(f"checkpoint file {file_path} has {size} bytes, manifest says {entry['bytes']} "
                            "(truncated or overwritten)")
    rels = sorted(files)
    try:
        digests = parallel_map(lambda rel: sha256_and_sync(os.path.join(path, rel)), rels)
    except FileNotFoundError as e:  # a file, or the directory, renamed away while it was hashed
        raise UserError(f"checkpoint file {e.filename} is missing") from None
    for rel, digest in zip(rels, digests):
        if digest != files[rel]["sha256"]:
            raise UserError(f"checkpoint file {os.path.join(path, rel)} fails its sha256 check (corrupted)")
    return manifest


def is_valid_checkpoint(path: str) -> bool:
    try:
        verify_checkpoint(path)
    except UserError:
        return False
    return True


def extra_with_step(state: dict) -> dict:
    """What a load returns: the saved extra state with "step" set (from a state.json dict)."""
    return {**state["extra"], "step": state["step"]}


# state.json's fields as its readers rely on them (loads, resume layout checks, pruning, the analysis)
PROGRESS_FIELDS = {"step": int, "tokens": int, "flops": (int, float), "wall_s": (int, float),
                   "nonfinite_skipped": int}


def read_checkpoint_state(path: str) -> dict:
    """The checkpoint's state.json: {"format", "step", "rng", "extra"[, "layout"]} (no verification), checked:
    `format` an integer or string, `step` a non-negative integer, `rng` a list, `extra` an object (its
    `milestone` a boolean, its `progress` an object of PROGRESS_FIELDS, its `loader` an object), `layout` an
    object of integers. Anything else is a UserError naming the file and field."""
    file = os.path.join(path, STATE)
    where = shown(file)
    state = expect_object(read_json(file), where)
    expect(state, "format", (int, str), where)
    if expect(state, "step", int, where) < 0:
        raise UserError(f"{where}: field 'step' must be >= 0, got {state['step']}")
    expect(state, "rng", list, where)
    extra = expect(state, "extra", dict, where)
    expect(extra, "milestone", bool, f"{where} extra", required=False)
    expect(extra, "loader", dict, f"{where} extra", required=False)
    progress = expect(extra, "progress", dict, f"{where} extra", required=False) or {}
    for key, kinds in PROGRESS_FIELDS.items():
        expect(progress, key, kinds, f"{where} extra.progress", required=False)
    expect(progress, "mod_account", (dict, type(None)), f"{where} extra.progress", required=False)
    unknown = sorted(set(progress) - set(PROGRESS_FIELDS) - {"mod_account"})
    if unknown:  # the trainer builds its Progress from these keys
        raise UserError(f"{where} extra.progress: unknown field(s) {shown(unknown)}")
    layout = expect(state, "layout", (dict, type(None)), where, required=False) or {}
    for key, value in layout.items():
        if value is not None:
            expect(layout, key, int, f"{where} layout")
    return state
