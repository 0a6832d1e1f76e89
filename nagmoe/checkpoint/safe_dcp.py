"""Loading a DCP checkpoint without executing arbitrary pickled code (issue 16, "safe loading").

torch 2.13's `FileSystemReader.read_metadata` reads `.metadata` with a plain `pickle.load`, and
`DefaultLoadPlanner.load_bytes` reads every non-tensor item (optimizer param_groups entries, ...) with
`torch.load(weights_only=False)`: a crafted checkpoint would run code at load. Our checkpoints are also
checked against their manifest first (sha256 of every file), but the manifest sits next to the files it
describes, so it proves integrity, not origin. Here:

  * `SafeFileSystemReader` unpickles `.metadata` with `RestrictedUnpickler`: only the DCP metadata
    dataclasses, torch.Size / dtypes / layouts / memory formats, pathlib paths and plain containers can be
    named; any other global (os.system, builtins.eval, ...) raises `UnsafeCheckpoint` before it is called.
  * `SafeLoadPlanner` reads the non-tensor items with `torch.load(weights_only=True)`.
  * Tensor payloads are raw storage bytes (no pickle).

`safe_dcp_load(state, checkpoint_id, no_dist)` is a drop-in for `dcp.load(state, checkpoint_id=...)`.
DeepSpeed checkpoints (parallel.engine=deepspeed) are NOT covered: DeepSpeed's loader unpickles with
`weights_only=False`; resume those only from directories you trust.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from nagmoe.errors import UserError

# Modules whose classes may be constructed by name: plain data descriptions of the checkpoint.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
# Individual globals (module, name). Functions are listed only when they just look a value up by name.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


class UnsafeCheckpoint(UserError):
    """A checkpoint file names code that a checkpoint has no business naming."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata needs (module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"checkpoint metadata names {module}.{name}, which a checkpoint may not "
                               "reference (refusing to unpickle it)")


def restricted_loads(data: bytes) -> Any:
    return RestrictedUnpickler(io.BytesIO(data)).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by `RestrictedUnpickler`. `refused`: the UserError that
    stopped the read (DCP wraps exceptions in a CheckpointException; `safe_dcp_load` re-raises this)."""

    refused: Optional[UserError] = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = RestrictedUnpickler(f).load()
            except UnsafeCheckpoint as e:
                self.refused = e
                raise
            except Exception as e:  # truncated or foreign bytes: one line, not a traceback
                self.refused = UserError(f"{path}: unreadable checkpoint metadata ({type(e).__name__})")
                raise self.refused from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor items with `torch.load(weights_only=True)`."""

    refused: Optional[UserError] = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = UnsafeCheckpoint(f"checkpoint item {read_item.dest_index.fqn} is not plain data "
                                            f"({str(e).splitlines()[0][:200]})")
            raise self.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state_dict: dict, checkpoint_id: str, no_dist: bool = False) -> None:
    """`dcp.load(state_dict, checkpoint_id=...)` with the safe reader and planner."""
    reader, planner = SafeFileSystemReader(checkpoint_id), SafeLoadPlanner()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException:  # a BaseException subclass in torch 2.13
        refused = reader.refused or planner.refused
        if refused is not None:  # ours, wrapped by DCP: the one line, not DCP's traceback text
            raise refused from None
        raise
