"""Reading DCP's `.metadata` without running whatever a pickle asks for.

DCP writes its index as a pickle and reads it back with a plain `pickle.load` (torch 2.13,
`FileSystemReader.read_metadata`): a crafted `.metadata` runs arbitrary code in every process
that loads the checkpoint. `load_metadata` unpickles with an allow-list of exactly the classes
DCP's metadata is made of (its dataclasses, torch.Size, dtypes and layouts, paths, enums); any
other global is refused before it is looked up, so nothing of the file's choosing is called.
`SafeFileSystemReader` is DCP's reader with that loader; DTorch uses it for every load and export.
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if not _ALLOWED:
        import pathlib

        from torch.distributed.checkpoint import filesystem, metadata
        from torch.serialization import _get_layout

        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"):
            _ALLOWED[(_DCP_META, name)] = getattr(metadata, name)
        _ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
        _ALLOWED[("torch", "Size")] = torch.Size
        _ALLOWED[("torch.serialization", "_get_layout")] = _get_layout  # looks a name up in a cache
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
            _ALLOWED[("pathlib", cls.__name__)] = cls
        _ALLOWED[("collections", "OrderedDict")] = collections.OrderedDict
        for v in vars(torch).values():
            if isinstance(v, torch.dtype):
                _ALLOWED[("torch", str(v).removeprefix("torch."))] = v
    return _ALLOWED


class UnsafeMetadata(Exception):
    """`.metadata` names something DCP's metadata never holds: it was crafted or corrupted."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed().get((module, name))
        if obj is None:
            raise UnsafeMetadata(f"refused to unpickle {module}.{name}: not a class of DCP metadata")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata("refused a persistent id: not part of DCP metadata")


def loads(data: bytes) -> Any:
    """Unpickle `data` admitting only DCP metadata classes; raises UnsafeMetadata otherwise."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadata:
        raise
    except Exception as e:  # a truncated or malformed pickle
        raise UnsafeMetadata(f"unreadable ({type(e).__name__}: {e})") from None


def load_metadata(path: str | Path) -> Metadata:
    """DCP's `Metadata` from a `.metadata` file, read with the allow-list."""
    md = loads(Path(path).read_bytes())
    if not isinstance(md, Metadata):
        raise UnsafeMetadata(f"holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's `FileSystemReader`, except that `.metadata` is read with the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = loads(f.read())
        if not isinstance(md, Metadata):
            raise UnsafeMetadata(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
