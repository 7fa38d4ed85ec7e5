"""The files of one fastcomm checkpoint: names, the hashed rank files, the manifest, and their verification.

A checkpoint directory ``step-000000100/`` holds ``rank0.pt`` ... ``rank{W-1}.pt`` and ``manifest.json``
(step, world size, and each file's size and SHA-256). This module writes and checks those files;
:mod:`fastcomm.checkpoint` decides when to write them, which one to restore and how to merge their states
(it re-exports :class:`CheckpointError` and :func:`verify_checkpoint`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "MANIFEST",
    "STEP_DIR",
    "VERSION",
    "CheckpointError",
    "fsync_dir",
    "rank_file",
    "step_name",
    "verify_checkpoint",
    "write_manifest",
    "write_rank_file",
]

FORMAT = "fastcomm-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 4 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: its files are missing, corrupt, or of another run."""

    __module__ = "fastcomm.checkpoint"  # its public home, in tracebacks and pickles


class _HashingWriter(io.RawIOBase):
    """A binary file that hashes (SHA-256) and counts what is written through it."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        super().__init__()
        self.handle = handle
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += view.nbytes
        self.handle.write(view)
        return view.nbytes


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a rename or a new file in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint directory."""
    return f"rank{rank}.pt"


def step_name(step: int) -> str:
    """The name of step ``step``'s checkpoint directory."""
    return f"step-{step:09d}"


def write_rank_file(path: Path, payload: Mapping[str, Any]) -> tuple[int, str]:
    """Write ``payload`` with ``torch.save`` to ``path``, fsynced; return its size and SHA-256."""
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(dict(payload), writer)
        handle.flush()
        os.fsync(handle.fileno())
    return writer.size, writer.digest.hexdigest()


def write_manifest(directory: Path, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest`` as ``directory/manifest.json`` atomically: a temporary name, fsync, rename."""
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(path: str | os.PathLike[str], ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """Check one checkpoint directory: its manifest, and the size and SHA-256 of the files of ``ranks``.

    Args:
        path: a ``step-*`` directory.
        ranks: the ranks whose files to hash (default: all of them).

    Returns:
        The manifest.

    Raises:
        CheckpointError: what is wrong, naming the file.

    Example::

        manifest = verify_checkpoint("ckpt/step-000000100")
        print(manifest["step"], manifest["world_size"])
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} is missing (the checkpoint was not finished)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{manifest_path} is unreadable: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a fastcomm checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_path} has version {manifest.get('version')}; this fastcomm reads version {VERSION}"
        )
    world = int(manifest["world_size"])
    for rank in range(world) if ranks is None else ranks:
        name = rank_file(rank)
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{manifest_path} lists no {name}")
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing") from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: SHA-256 mismatch (the file is corrupt or was changed)")
    return manifest
