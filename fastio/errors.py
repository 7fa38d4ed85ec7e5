"""The errors fastio raises on purpose. Each names the file (and the field, where there is one) it is about.

Example::

    try:
        loader = fastio.StreamLoader("data/train", batch_size=256)
    except fastio.CorruptShardError as err:
        print(err.path, err.field, err.expected, err.actual)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CorruptShardError",
    "EmptySourceError",
    "FastIOError",
    "MissingFieldError",
    "MissingIndexError",
    "SchemaMismatchError",
    "WorkerTimeoutError",
]


class FastIOError(Exception):
    """Base class of every error fastio raises about its inputs."""


class CorruptShardError(FastIOError):
    """A shard's bytes disagree with what its header or index says (size, checksum, offsets).

    Example::

        err = CorruptShardError("a.fio", "x", "crc32 0x1234", "crc32 0x9999")
        assert "a.fio" in str(err) and "x" in str(err)
    """

    def __init__(self, path: str, field: str, expected: Any, actual: Any, detail: str = "") -> None:
        self.path, self.field, self.expected, self.actual = str(path), field, expected, actual
        self.detail = detail
        msg = f"{self.path}: field {field!r}: expected {expected}, found {actual}"
        super().__init__(msg + (f" ({detail})" if detail else ""))

    def __reduce__(self) -> tuple:  # rebuilt from its fields when it crosses from a worker process
        return (type(self), (self.path, self.field, self.expected, self.actual, self.detail))


class MissingIndexError(FastIOError, FileNotFoundError):
    """A shard set or tar shard has no index and none may be built.

    Example::

        err = MissingIndexError("data/train/index.json", "write the set with fastio.ShardWriter")
    """

    def __init__(self, path: str, hint: str) -> None:
        self.path, self.hint = str(path), hint
        super().__init__(f"{self.path}: index not found; {hint}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.hint))


class SchemaMismatchError(FastIOError):
    """A sample or shard does not match the schema it is meant to follow.

    Example::

        err = SchemaMismatchError("train/shard-000001.fio", "x", "uint8 (3, 32, 32)", "uint8 (3, 16, 16)")
    """

    def __init__(self, path: str, field: str, expected: Any, actual: Any) -> None:
        self.path, self.field, self.expected, self.actual = str(path), field, expected, actual
        super().__init__(f"{self.path}: field {field!r}: schema says {expected}, found {actual}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.field, self.expected, self.actual))


class MissingFieldError(SchemaMismatchError, KeyError):
    """A batch lacks the field a stage reads (``ImageStage("jpeg")`` on samples whose images are ``.jpg``
    members). Names the fields the samples have, and the closest one; a ``KeyError`` too, as before.

    Example::

        err = MissingFieldError("ImageStage(field='jpeg')", "jpeg", ["cls", "jpg"])
        assert str(err).endswith("pass field='jpg'")
    """

    def __init__(self, reader: str, field: str, available: Sequence[str]) -> None:
        self.path, self.field, self.available = str(reader), field, list(available)
        self.expected, self.actual = f"a field {field!r}", self.available
        shown = ", ".join(repr(name) for name in self.available) or "none"
        close = difflib.get_close_matches(field, self.available, n=1)
        fix = f"pass field={close[0]!r}" if close else "pass field= one of them"
        message = f"{self.path}: the samples have no field {field!r}; their fields: {shown}: {fix}"
        Exception.__init__(self, message)

    def __str__(self) -> str:  # KeyError's would show the message in quotes
        return str(self.args[0])

    def __reduce__(self) -> tuple:
        return (type(self), (self.path, self.field, self.available))


class EmptySourceError(FastIOError, ValueError):
    """A source holds no samples (an empty directory, a pattern matching no file, zero-sample shards).

    Example::

        err = EmptySourceError("data/empty: empty directory")
    """


class WorkerTimeoutError(FastIOError, RuntimeError):
    """A worker did not hand over a batch within the loader's ``timeout=`` seconds (DataLoader raises a
    ``RuntimeError`` there: this is one). The loader's workers are stopped; nothing hangs.

    Example::

        err = WorkerTimeoutError("fastio: batch 3 not made within timeout=5.0 s")
    """
