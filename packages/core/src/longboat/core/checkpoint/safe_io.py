"""DCP reading without unrestricted pickle.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and
``DefaultLoadPlanner`` loads non-tensor entries with ``weights_only=False``;
either would run code hidden in a crafted checkpoint. These subclasses load the
metadata through an allow-listed unpickler and non-tensor entries with
``weights_only=True``.
"""

from __future__ import annotations

import inspect
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner"]

_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: DCP's own dataclasses, torch dtypes/Size, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            if module.startswith("pathlib"):
                return getattr(pathlib, name)
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.memory_format, torch.layout)):
                return obj
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            # Only classes (dataclasses, enums) defined by DCP itself.
            if inspect.isclass(obj) and obj.__module__ in _DCP_MODULES:
                return obj
        raise pickle.UnpicklingError(
            f"checkpoint metadata references {module}.{name}, which a DCP checkpoint never "
            "contains; refusing to unpickle it (the .metadata file is corrupted or crafted)"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata load cannot execute arbitrary code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
