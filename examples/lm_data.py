"""The data of ``train_lm.py``: the Python standard library's own source as fastio shards of byte windows.

1. Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` of the running Python (sorted by path,
   ``site-packages`` excluded); every 20th file (by position in that order) is held out as validation (5%,
   by file).
2. Each split's files, each followed by a NUL byte, are one byte stream (tokens of a vocabulary of 256) cut
   into windows of 129 bytes that overlap by one (window ``i`` is bytes ``128 i .. 128 i + 128``, so every
   byte is a target once), written once to fastio shards (``fastio.ShardWriter``, a fixed ``uint8 (129,)``
   field) in a cache directory named by a fingerprint of the file list: a rerun reuses them and a changed
   stdlib gets new ones.
3. Loading: ``fastio.StreamLoader(..., shuffle=True, seed=seed, drop_last=True)``: a batch is drawn from
   the whole corpus, each rank a disjoint share of one global permutation, the order fixed by the seed.

Example::

    from lm_data import default_data_dir, loader, prepare_data

    paths = prepare_data(default_data_dir(), max_files=40)
    batches = loader(paths.train, batch_size=16, seed=0, rank=0, world=1)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fastio

__all__ = [
    "EOS",
    "VAL_SEED",
    "VOCAB",
    "WINDOW",
    "DataPaths",
    "EpochStream",
    "default_data_dir",
    "loader",
    "prepare_data",
    "stdlib_sources",
]

VOCAB = 256
EOS = 0  # the NUL byte: never in a Python source file, so it marks document ends unambiguously
VAL_EVERY_NTH_FILE = 20  # 5% of the files, by file
WINDOW = 129  # a row: inputs and targets of a context of up to 128
VAL_SEED = 1234  # which validation rows are read: the same for every run and method
_DATA_FORMAT = 4  # bump when the shard contents for the same file list change


@dataclasses.dataclass(frozen=True)
class DataPaths:
    """The shard directories of one prepared data set, and what is in them."""

    train: Path
    val: Path
    train_files: int
    val_files: int
    train_bytes: int
    val_bytes: int


def stdlib_sources(max_files: int | None = None) -> list[tuple[str, Path]]:
    """The running interpreter's stdlib ``.py`` files as ``(relative posix path, path)``, sorted by path.

    ``max_files`` keeps an evenly spaced subset of that many (at least 20, so 5% is at least one file).

    Example::

        files = stdlib_sources(max_files=40)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = sorted(
        (path.relative_to(root).as_posix(), path)
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts and "__pycache__" not in path.parts and path.is_file()
    )
    if not found:
        raise FileNotFoundError(f"no .py files under the stdlib directory {root}")
    if max_files is not None:
        if max_files < VAL_EVERY_NTH_FILE:
            raise ValueError(f"max_files must be >= {VAL_EVERY_NTH_FILE} (5% is a file), got {max_files}")
        stride = max(1, len(found) // max_files)
        found = found[::stride][:max_files]
    return found


def default_data_dir() -> Path:
    """Where prepared shards are cached: ``$FASTCOMM_DATA_DIR``, else ``~/.cache/fastcomm/train_lm``."""
    if os.environ.get("FASTCOMM_DATA_DIR"):
        return Path(os.environ["FASTCOMM_DATA_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastcomm" / "train_lm"


def _fingerprint(files: Sequence[tuple[str, Path]]) -> str:
    digest = hashlib.sha256(f"format {_DATA_FORMAT} python {sys.version_info[:3]}".encode())
    for rel, path in files:
        digest.update(f"{rel}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]


def _write_windows(directory: Path, files: Sequence[tuple[str, Path]]) -> int:
    """The files (each followed by ``EOS``) as one byte stream cut into ``WINDOW``-byte rows overlapping by
    one byte; returns the files' bytes."""
    eos = np.array([EOS], dtype=np.uint8)
    stream = np.concatenate([x for _, p in files for x in (np.frombuffer(p.read_bytes(), np.uint8), eos)])
    rows = np.lib.stride_tricks.sliding_window_view(stream, WINDOW)[:: WINDOW - 1]
    schema = {"tokens": ("uint8", (WINDOW,)), "index": ("int64", ())}
    with fastio.ShardWriter(directory, schema=schema, max_samples=1 << 16) as w:
        w.write_many({"tokens": np.ascontiguousarray(rows), "index": np.arange(len(rows), dtype=np.int64)})
    return int(stream.size - len(files))


def prepare_data(cache_dir: str | os.PathLike[str], max_files: int | None = None) -> DataPaths:
    """Write the stdlib's source as train/val fastio shards under ``cache_dir`` (once) and return them.

    1. List the files (:func:`stdlib_sources`); the set's directory is named by a fingerprint of their
       relative paths and sizes, the Python version and this format's version.
    2. If that directory exists, return it. Otherwise write both splits into a temporary sibling, then
       rename it into place, so a crash never leaves a half-written set and concurrent preparers agree.

    Args:
        cache_dir: the cache directory (created if missing).
        max_files: an evenly spaced subset of this many files (for quick runs), or None for all.

    Returns:
        The :class:`DataPaths` of the set.

    Example::

        paths = prepare_data(default_data_dir())
        loader = fastio.StreamLoader(paths.train, batch_size=16, shuffle=True)
    """
    files = stdlib_sources(max_files)
    val = [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE // 2]
    train = [f for i, f in enumerate(files) if i % VAL_EVERY_NTH_FILE != VAL_EVERY_NTH_FILE // 2]
    root = Path(cache_dir)
    final = root / f"stdlib-{_fingerprint(files)}"
    meta_path = final / "meta.json"
    if not meta_path.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        meta = {
            "train_files": len(train), "val_files": len(val),
            "train_bytes": _write_windows(tmp / "train", train),
            "val_bytes": _write_windows(tmp / "val", val),
            "stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not meta_path.exists():  # not another preparer that finished first: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads(meta_path.read_text())
    return DataPaths(final / "train", final / "val", meta["train_files"], meta["val_files"],
                     meta["train_bytes"], meta["val_bytes"])


def loader(directory: Path, batch_size: int, seed: int, rank: int, world: int) -> fastio.StreamLoader:
    """This rank's shuffled loader of a split: full batches of ``batch_size`` rows, the order fixed by
    ``seed`` (and the epoch), each rank a disjoint share."""
    return fastio.StreamLoader(directory, batch_size=batch_size, shuffle=True, seed=seed, drop_last=True,
                               pin_memory=False, order=fastio.OrderOptions(rank=rank, world_size=world))


class EpochStream:
    """Batches of a loader without end: the next epoch (its own order) starts when one runs out."""

    def __init__(self, loader: fastio.StreamLoader) -> None:
        self.loader = loader
        self._iterator: Iterator[Any] | None = None

    def next(self) -> dict[str, torch.Tensor]:
        for _ in range(2):
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.loader.set_epoch(self.loader.epoch + 1)
        raise RuntimeError(f"the training stream of rank {self.loader.rank} has no full batch in an epoch")
