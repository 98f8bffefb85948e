"""Reading files from the shared filesystem, which anyone who can write there controls (arch §6;
docs/architecture.md §3, "What is untrusted").

- **Nothing unpickled runs code.** DCP's ``FileSystemReader`` loads ``.metadata`` with plain
  ``pickle.load`` and its default planner non-tensor entries with ``torch.load(weights_only=
  False)``; a manifest digest stops neither (whoever writes ``.metadata`` can rewrite
  ``manifest.json``). Use :func:`dcp_load_args` for every ``dcp.load``.
- **A name from a file is one plain path component** (:func:`check_component`).

Refusals raise :class:`UnsafeCheckpointError` / :class:`UnsafeNameError`, naming the file.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainer.errors import TrainerError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
# A conservative single path component: no separators, no leading dot (no ".", "..", hidden
# files), no NUL or control characters. fullmatch, never match + "$": "$" accepts a final "\n".
SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")


class UnsafeNameError(TrainerError, ValueError):
    """A name read from an untrusted file is not a single safe path component."""


class UnsafeCheckpointError(TrainerError, RuntimeError):
    """A checkpoint file asks for something no checkpoint holds (a class outside the allowlist,
    a path outside its directory): refused before anything it names is called or opened."""


def check_component(value: object, *, where: str) -> str:
    """``value`` if it is one safe path component, else :class:`UnsafeNameError` naming ``where``
    (the file and field) and the value."""
    if not isinstance(value, str) or not SAFE_COMPONENT.fullmatch(value):
        raise UnsafeNameError(
            f"{where}: {value!r} is not a plain file name (letters, digits, '_.+-', not starting "
            "with '.', no '/', '\\', '..' or control characters): refusing it"
        )
    return value


# -- restricted unpickling ------------------------------------------------------------------------
# Exactly the globals DCP metadata pickles reference (listed from real torch 2.x checkpoints of
# this trainer, 1 and 2 ranks, with a recording find_class), plus OrderedDict, which older DCP
# versions used for state_dict_metadata. Every one is a plain data class or a lookup by name.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_MD, "Metadata"),
        (_DCP_MD, "MetadataIndex"),
        (_DCP_MD, "StorageMeta"),
        (_DCP_MD, "TensorProperties"),
        (_DCP_MD, "TensorStorageMetadata"),
        (_DCP_MD, "BytesStorageMetadata"),
        (_DCP_MD, "ChunkStorageMetadata"),
        (_DCP_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
        ("collections", "OrderedDict"),
    }
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _is_torch_dtype(module: str, name: str) -> bool:
    if module != "torch" or not _IDENT.fullmatch(name):  # no dotted lookups (protocol 4)
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only what DCP metadata is made of; any other global is refused before it is
    imported, so a ``__reduce__`` naming ``os.system`` never gets to run."""

    def __init__(self, file: IO[bytes], *, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_torch_dtype(module, name):
            if (module, name) == ("collections", "OrderedDict"):
                return OrderedDict
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to unpickle {module}.{name} (DCP metadata holds only "
            "torch.distributed.checkpoint metadata classes, torch.Size and dtypes): the file was "
            "not written by DCP and is not trusted"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: persistent ids are not part of DCP metadata")


def _check_metadata(md: object, source: str) -> Metadata:
    """The unpickled object is DCP metadata whose storage entries stay in their directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise UnsafeCheckpointError(f"{source}: not DCP metadata ({type(md).__name__})")
    # torch joins each entry's relative_path onto the checkpoint directory and opens it.
    for index, info in (md.storage_data or {}).items():
        try:
            check_component(getattr(info, "relative_path", None), where=f"{source}: {index}")
        except UnsafeNameError as e:
            raise UnsafeCheckpointError(str(e)) from e
    return md


def load_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of a checkpoint directory (or ``.metadata`` file), restricted-unpickled.
    Check the file's digest first (arch §6)."""
    path = Path(path)
    file = path / METADATA if path.is_dir() else path
    return loads_dcp_metadata(file.read_bytes(), source=str(file))


def loads_dcp_metadata(data: bytes, *, source: str) -> Metadata:
    try:
        md = RestrictedUnpickler(io.BytesIO(data), source=source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated, flipped bits, wrong types: all mean "not DCP metadata"
        raise UnsafeCheckpointError(
            f"{source}: not readable DCP metadata ({type(e).__name__}: {e})"
        ) from e
    return _check_metadata(md, source)


# -- DCP reader and planner -----------------------------------------------------------------------
def _reader_and_planner() -> tuple[type, type]:
    # Built lazily: importing torch.distributed.checkpoint costs seconds, and trainer.checkpointing
    # (which many light tools import) must not pay it.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeFileSystemReader(FileSystemReader):
        """A ``FileSystemReader`` whose metadata goes through :class:`RestrictedUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # Rank-local metadata (``__R.metadata``) is never written by this trainer and no
            # manifest vouches for it: refusing it stops DCP's silent fallback to it.
            if kwargs.get("rank") is not None:
                raise UnsafeCheckpointError(
                    f"{self.path}: rank-local DCP metadata is not used (only {METADATA})"
                )
            md = load_dcp_metadata(Path(self.path) / METADATA)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            assert md.storage_meta is not None
            md.storage_meta.load_id = self.load_id  # what the base reader does
            return md

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, except that non-tensor entries (optimizer hyperparameters
        and the like) are loaded with ``weights_only=True`` rather than a full unpickle."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import torch
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader, SafeLoadPlanner


def dcp_load_args(path: Path | str) -> dict[str, Any]:
    """Keyword arguments that make ``dcp.load`` read ``path`` without running code from it:
    ``dcp.load(state, process_group=pg, **dcp_load_args(path))``."""
    reader_cls, planner_cls = _reader_and_planner()
    return {"storage_reader": reader_cls(str(path)), "planner": planner_cls()}
