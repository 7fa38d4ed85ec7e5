"""What :class:`fastio.StreamLoader` packs and how: the :class:`Pack` options of ``pack=`` (the packing
itself: :mod:`fastio.assembly.pack`).

Example::

    pack = fastio.Pack("tokens", seq_len=2048, eos=50256, shift=True)
    print(pack.row_len)   # 2049
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["Pack"]


@dataclasses.dataclass(frozen=True)
class Pack:
    """How :class:`fastio.StreamLoader` packs a variable-length token field (see :mod:`fastio.assembly.pack`).

    Args:
        field: a 1-D variable-length integer array field
            (``ShardWriter(schema={"tokens": ("int32", None)})``), or a ``.npy`` member of tar shards
            (``"tokens.npy"``: 1-D integer arrays of one dtype).
        seq_len: tokens per row (``seq_len + 1`` with ``shift``).
        eos: a token placed after every document, or None for none.
        shift: rows of ``seq_len + 1`` tokens overlapping by one, for ``inputs = row[:, :-1]``,
            ``targets = row[:, 1:]``.
        dtype: the output dtype of ``"tokens"`` (default: the field's); it must hold every value of the
            field's dtype (``int32`` -> ``int64`` yes, ``int32`` -> ``int16`` no).
        document_ids: add ``"document_ids"`` (int32 ``[b, L]``, the document's number within its row).
        positions: add ``"positions"`` (int32 ``[b, L]``, the position within the document's piece).

    Example::

        pack = fastio.Pack("tokens", seq_len=2048, eos=50256, shift=True, dtype=torch.int64)
    """

    field: str = "tokens"
    seq_len: int = 1024
    eos: int | None = None
    shift: bool = False
    dtype: torch.dtype | None = None
    document_ids: bool = True
    positions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.field, str) or not self.field:
            raise ValueError(f"Pack field must be a field name, got {self.field!r}")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, (int, np.integer)):
            raise ValueError(f"Pack seq_len must be an int >= 1, got {self.seq_len!r}")
        if self.seq_len < 1:
            raise ValueError(f"Pack seq_len must be >= 1, got {self.seq_len}")
        if self.eos is not None and (
            isinstance(self.eos, bool) or not isinstance(self.eos, (int, np.integer))
        ):
            raise ValueError(f"Pack eos must be None or an int token, got {self.eos!r}")
        if self.dtype is not None and (
            not isinstance(self.dtype, torch.dtype)
            or self.dtype.is_floating_point
            or self.dtype.is_complex
            or self.dtype == torch.bool
        ):
            raise ValueError(f"Pack dtype must be a torch integer dtype, got {self.dtype!r}")
        object.__setattr__(self, "seq_len", int(self.seq_len))
        object.__setattr__(self, "eos", None if self.eos is None else int(self.eos))

    @property
    def row_len(self) -> int:
        """Tokens per output row: ``seq_len``, or ``seq_len + 1`` with ``shift``."""
        return self.seq_len + int(self.shift)
