"""Loading a DCP checkpoint without executing pickled code.

torch's `FileSystemReader.read_metadata` reads `.metadata` with a plain `pickle.load`, and
`DefaultLoadPlanner.load_bytes` reads every non-tensor item (optimizer param_groups entries, ...) with
`torch.load(weights_only=False)`: a crafted checkpoint would run code at load. The manifest next to the files
proves integrity, not origin (anyone can recompute it). Here:

  * `.metadata` is read by `MetadataUnpickler` before DCP sees it (DCP then gets the parsed object, so a
    refusal is our one line, not DCP's logged retries), under an exact allow-list:
      - a global is looked up only as an exact (module, name) pair on `_allowed_globals()`, never through
        a dotted name (protocol 4 would otherwise walk module attributes: `os.system` from any module that
        imports os);
      - the pairs are the classes DCP metadata is made of, `torch.Size`, `OrderedDict`, pathlib paths,
        the dtypes (values, not callables) and one lookup `torch.serialization._get_layout`, replaced by
        `_layout_by_name`, which returns only a `torch.layout` constant; no module object, function or
        builtin is ever handed to the pickle;
      - BUILD (attribute writes / `__setstate__`) only on instances of the allowed classes, never on a
        class;
      - afterwards the object must be a `Metadata` whose storage entries name plain files inside the
        checkpoint directory (no path separators, no `..`): hostile constructor arguments stay data.
  * `SafeLoadPlanner` reads the non-tensor items with `torch.load(weights_only=True)`.
  * Tensor payloads are raw storage bytes (no pickle).

`safe_dcp_load(state, checkpoint_id, no_dist)` is a drop-in for `dcp.load(state, checkpoint_id=...)`.
"""
from __future__ import annotations

import collections
import io
import logging
import os
import pathlib
import pickle
import re
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from nagmoe.base.errors import UserError, shown

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_LAYOUTS = {f"torch.{name}": getattr(torch, name) for name in ("strided", "sparse_coo", "sparse_csr",
                                                                 "sparse_csc", "sparse_bsr", "sparse_bsc",
                                                                 "_mkldnn") if hasattr(torch, name)}


class UnsafeCheckpoint(UserError):
    """A checkpoint file names code, or data, that a checkpoint has no business naming."""


def _layout_by_name(name: str) -> torch.layout:
    """Stands in for `torch.serialization._get_layout` (how a pickled torch.layout is looked up)."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise UnsafeCheckpoint(f"names the layout {name!r}, which is not a torch layout")
    return _LAYOUTS[name]


@lru_cache(maxsize=1)
def _allowed_globals() -> dict:
    """(module, name) -> the object a pickle may reference by that exact pair."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict = {(_METADATA_MODULE, n): getattr(metadata, n) for n in _METADATA_CLASSES if hasattr(metadata, n)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for module in ("pathlib", "pathlib._local"):  # python >= 3.13 pickles paths from pathlib._local
        for name in ("Path", "PosixPath", "PurePosixPath"):
            allowed[(module, name)] = getattr(pathlib, name)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    return allowed


@lru_cache(maxsize=1)
def _buildable_types() -> tuple:
    return tuple(v for v in _allowed_globals().values() if isinstance(v, type))


class MetadataUnpickler(pickle._Unpickler):
    """The pure-python unpickler with `find_class` and BUILD restricted (module docstring). The pure-python
    class is used because the C unpickler's opcode table cannot be changed."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_globals().get((module, name)) if "." not in name else None
        if obj is None:
            raise UnsafeCheckpoint(f"names {module}.{name}, which a checkpoint may not reference")
        return obj

    def load_build(self) -> None:
        target = self.stack[-2]  # BUILD pops the state (top) and applies it to the object below it
        if isinstance(target, type) or not isinstance(target, _buildable_types()):
            what = f"the class {target.__name__}" if isinstance(target, type) else type(target).__name__
            raise UnsafeCheckpoint(f"sets attributes on {what}, which a checkpoint may not do")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("uses a persistent id, which DCP metadata never does")


def _check_metadata(metadata: Any) -> None:
    """The parsed metadata is a Metadata whose storage entries name plain files in the checkpoint dir."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        ok = (isinstance(info, _StorageInfo) and isinstance(rel, str) and rel not in ("", ".", "..")
              and os.path.basename(rel) == rel and "\\" not in rel and "\0" not in rel
              and all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)))
        if not ok:
            raise UnsafeCheckpoint(f"has a storage entry outside the checkpoint directory ({rel!r})")


def read_metadata_file(path: str) -> Any:
    """The DCP metadata in file `path`, unpickled under the allow-list; UnsafeCheckpoint / UserError name the
    file (one line)."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        _check_metadata(metadata)
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{path}: refused: {e}") from None
    except Exception as e:  # truncated or foreign bytes, or an allowed class given bad arguments
        raise UserError(f"{path}: unreadable checkpoint metadata ({type(e).__name__})") from None
    return metadata


def restricted_loads(data: bytes) -> Any:
    """Unpickle bytes under the metadata allow-list (no structural check)."""
    return MetadataUnpickler(io.BytesIO(data)).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that returns metadata already read by `read_metadata_file`."""

    def __init__(self, path: str, metadata: Any):
        super().__init__(path)
        self._checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = self._checked_metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def refused_by_weights_only(error: Exception) -> str:
    """What `torch.load(weights_only=True)` refused, in a few words (its message is a page long)."""
    text = str(error)
    match = (re.search(r"Unsupported global: GLOBAL (\S+)", text)
             or re.search(r"unsupported GLOBAL (\S+)", text)
             or re.search(r"WeightsUnpickler error: ([^\n]+)", text))
    if match:
        return f"names {match.group(1)}"
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("Weights only load failed")]
    return (lines[0] if lines else text.splitlines()[0])[:200]


def weights_only_load(source, what: str, map_location=None, allowed_classes: tuple = ()) -> Any:
    """`torch.load(source, weights_only=True)` (plus `allowed_classes`); a refusal is one UnsafeCheckpoint
    line naming `what` (the file) and the refused global, any other failure one UserError line."""
    try:
        with torch.serialization.safe_globals(list(allowed_classes)):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{what}: refused: {refused_by_weights_only(e)}, which a checkpoint may not "
                               "reference") from None
    except Exception as e:  # truncated or foreign bytes
        raise UserError(f"{what}: unreadable ({type(e).__name__})") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with `torch.load(weights_only=True)`."""

    refused: Optional[UserError] = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = weights_only_load(value, f"checkpoint item {read_item.dest_index.fqn}")
        except UserError as e:
            self.refused = e
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@contextmanager
def _quiet_dcp_logs():
    """DCP logs a refused load (with a traceback) before raising; our refusal is the one line."""
    logger = logging.getLogger("torch.distributed.checkpoint")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _check_model_keys(state_dict: dict, metadata: Any, checkpoint_id: str) -> None:
    """Every model tensor the loading model has must be in the checkpoint: a structural config change (a buffer
    that exists only when an option is on, e.g. model.moe.expert_bias) is one line here, not DCP's traceback."""
    model = state_dict.get("model") if isinstance(state_dict, dict) else None
    if not isinstance(model, dict):
        return
    saved = set(getattr(metadata, "state_dict_metadata", {}) or {})
    missing = sorted(k for k in model if f"model.{k}" not in saved)
    if missing:
        raise UserError(f"{checkpoint_id}: the checkpoint has no {shown(missing[0])} ({len(missing)} model tensor"
                        f"{'s' if len(missing) != 1 else ''} the config needs are missing: a structural change "
                        "such as model.moe.expert_bias=true cannot resume it; use the config it was saved with)")


def safe_dcp_load(state_dict: dict, checkpoint_id: str, no_dist: bool = False) -> None:
    """`dcp.load(state_dict, checkpoint_id=...)` with the checked metadata and the safe planner."""
    metadata = read_metadata_file(os.path.join(checkpoint_id, ".metadata"))
    _check_model_keys(state_dict, metadata, checkpoint_id)
    reader, planner = SafeFileSystemReader(checkpoint_id, metadata), SafeLoadPlanner()
    try:
        with _quiet_dcp_logs():
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException:  # a BaseException subclass in torch 2.13
        if planner.refused is not None:  # ours, wrapped by DCP: the one line, not DCP's traceback text
            raise type(planner.refused)(f"{checkpoint_id}: {planner.refused}") from None
        raise
